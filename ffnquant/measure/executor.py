"""Where independent tasks run: in this process (`local`, the default) or as Ray tasks on a cluster (`ray`).

A task is a module-level function of ffnquant called on one picklable payload, so a worker imports it by
name and its result depends on the payload alone (seeds travel in it): the same payload gives the same
result on any executor. `map` returns results in input order; `as_completed` yields (index, result) as tasks
finish, so a caller can fold results in and free them early. `share` stores a large value once (a layer's
captured inputs) for many tasks to read (`Shared.get`). Nothing here prints.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from .. import __version__
from ..errors import FFNQuantError, first_line, unknown_choice

__all__ = ["INSTALL_HINT", "Shared", "Executor", "LocalExecutor", "RayExecutor", "EXECUTORS", "get_executor"]

INSTALL_HINT = 'pip install ".[ray]" from the ffnquant checkout'
Resources = Sequence[Mapping[str, Any]]


class Shared(Protocol):
    """A value stored once for many tasks; `get()` returns it wherever the task runs."""

    def get(self) -> Any: ...


class Executor(Protocol):
    """Runs `fn(item)` for every item. `in_process`: tasks run in this process (their side effects are seen).

    `resources` (Ray only): per item, what its task needs (`{"num_gpus": 1}` places a CUDA case on a GPU node).
    """

    name: str
    in_process: bool

    def as_completed(self, fn: Callable[[Any], Any], items: Iterable[Any],
                     resources: Resources | None = None) -> Iterator[tuple[int, Any]]: ...

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], resources: Resources | None = None) -> list: ...

    def share(self, value: Any) -> Shared: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Executor": ...

    def __exit__(self, *exc: Any) -> None: ...


def _ordered(pairs: Iterable[tuple[int, Any]]) -> list:
    got = dict(pairs)
    return [got[i] for i in range(len(got))]


@dataclass(frozen=True)
class _Held:
    value: Any

    def get(self) -> Any:
        return self.value


class LocalExecutor:
    """Every task in this process, one after another in input order: exactly the loop it replaces."""

    name = "local"
    in_process = True

    def as_completed(self, fn, items, resources=None):
        for i, item in enumerate(items):
            yield i, fn(item)

    def map(self, fn, items, resources=None):
        return _ordered(self.as_completed(fn, items))

    def share(self, value: Any) -> Shared:
        return _Held(value)

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "hosts": [socket.gethostname()], "workers": 1}

    def close(self) -> None:
        pass

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class _RayShared:
    ref: Any  # a ray.ObjectRef; pickled into a task's payload, Ray lends the object to that task

    def get(self) -> Any:
        import ray

        return ray.get(self.ref)


def _ray_task(fn: Callable[[Any], Any], item: Any, version: str) -> Any:
    """One task on a Ray worker: refuse another ffnquant than the driver's (its numbers could differ)."""
    if version != __version__:
        raise FFNQuantError(f"the Ray worker on {socket.gethostname()} has ffnquant {__version__}, the driver "
                            f"{version}: install the same ffnquant on every node")
    return fn(item)


class RayExecutor:
    """Ray tasks on the cluster at `address` (else `RAY_ADDRESS`, else a local Ray instance started here).

    Joins a Ray already initialised in this process instead (and leaves it running on `close`). Each task
    asks for `cpus_per_task` CPUs, which is also how many threads Ray lets torch use in it.
    """

    name = "ray"
    in_process = False

    def __init__(self, address: str | None = None, cpus_per_task: float = 1, init: Mapping[str, Any] | None = None):
        try:
            import ray
        except ImportError as exc:
            raise FFNQuantError(f"--executor ray needs Ray, which is not installed here ({first_line(exc)}); "
                                f"install it with: {INSTALL_HINT}") from None
        self._ray = ray
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.cpus_per_task = cpus_per_task
        if self.address:
            _check_reachable(self.address)
        self._owner = not ray.is_initialized()
        if self._owner:
            import logging

            try:  # the worker logs stay on the cluster: a task's failure comes back as its exception
                ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                         **({"include_dashboard": False} if self.address is None else {}), **dict(init or {}))
            except Exception as exc:
                where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
                why = first_line(exc) + (f" ({first_line(exc.__cause__)})" if exc.__cause__ is not None else "")
                raise FFNQuantError(
                    f"cannot start or reach {where}: {why}; start a cluster with `ray start --head` and pass its "
                    "address (--ray-address or RAY_ADDRESS), or leave both unset for a local instance") from None
        self._remote = ray.remote(_ray_task)

    def as_completed(self, fn, items, resources=None):
        ray = self._ray
        items = list(items)
        refs = []
        for i, item in enumerate(items):
            options = {"num_cpus": self.cpus_per_task, **(resources[i] if resources else {})}
            refs.append(self._remote.options(**options).remote(fn, item, _version()))
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                yield index[done[0]], self._get(done[0])
        finally:  # an error, Ctrl-C or a caller that stops early leaves no task running on the cluster
            for ref in pending:
                ray.cancel(ref, force=True)

    def _get(self, ref: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None  # the task's own error, as the local path would raise it
            raise _cluster_error(cause or exc) from None
        except ray.exceptions.RayError as exc:  # a worker or node died, an object was lost
            raise _cluster_error(exc) from None

    def map(self, fn, items, resources=None):
        return _ordered(self.as_completed(fn, items, resources))

    def share(self, value: Any) -> Shared:
        return _RayShared(self._ray.put(value))

    def describe(self) -> dict[str, Any]:
        ray = self._ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
        here = ray.get_runtime_context().gcs_address
        return {"executor": self.name, "address": self.address or f"local instance ({here})",
                "hosts": sorted({str(n.get("NodeManagerHostname") or n.get("NodeManagerAddress")) for n in nodes}),
                "cpus": total.get("CPU"), "gpus": total.get("GPU"), "cpus_per_task": self.cpus_per_task}

    def close(self) -> None:
        """Shut down the Ray this executor started (a Ray someone else initialised keeps running)."""
        if self._owner and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _cluster_error(exc: BaseException) -> FFNQuantError:
    # a worker that cannot import a task's code most often lacks ffnquant (or has another version of it)
    hint = "; every Ray node needs ffnquant installed, the same version as here" if "No module named" in str(exc) else ""
    return FFNQuantError(f"a Ray task failed on the cluster: {first_line(exc)}{hint}")


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a host:port nothing answers at: Ray itself retries such an address for many minutes."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return  # 'auto' and the like: Ray resolves them itself, and says at once when there is nothing
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise FFNQuantError(f"cannot reach the Ray cluster at {address}: {exc.strerror or first_line(exc)}; start one "
                            "there with `ray start --head` (it prints the address to pass), or leave --ray-address and "
                            "RAY_ADDRESS unset for a local Ray instance") from None


def _version() -> str:
    return __version__


EXECUTORS: Mapping[str, str] = {
    "local": "in this process, one task after another",
    "ray": "Ray tasks on the cluster at --ray-address or RAY_ADDRESS, else on a local Ray instance "
           f"({INSTALL_HINT})",
}


def get_executor(name: str = "local", address: str | None = None, **options: Any) -> Executor:
    """The executor called `name` ('local' or 'ray'); an unknown name lists the valid ones."""
    key = str(name).strip().lower()
    if key not in EXECUTORS:
        raise unknown_choice("executor", name, EXECUTORS)
    if key == "local":
        if address:
            raise FFNQuantError(f"a Ray address ({address}) is for --executor ray; --executor local runs in this process")
        return LocalExecutor()
    return RayExecutor(address, **options)
