"""Pass 4 of `source.PlanSource`: each verification round, the held-out text streamed through every layer quantized
as chosen and scored against the float model's figures (each layer quantized from its kept inputs again, or the
FFN the scoring pass or the last round kept: the quantizers are deterministic); a round starts from the last
round's stream before the first layer it changes. A plan verified in a low precision (`dtype`: bf16 for a bf16
checkpoint that compressed-tensors will serve) runs the rounds on a second engine computing in it, against the
float model's figures in that dtype (measured once, on first use)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..recipe import Recipe

__all__ = ["VerificationRounds"]


class VerificationRounds:
    """`PlanSource`'s verification rounds (a mixin: it reads the source's engine, kept inputs and float figures)."""

    def verify(self, chosen: Mapping[int, str], by_name: Mapping[str, Recipe]) -> dict[str, dict]:
        """The end-to-end figures of the layers quantized as `chosen` ({index: name}) on each held-out domain
        ({label: figures}), the held-out text streamed through every layer once (in the plan's `dtype`)."""
        from ..hf.checkpoint import iter_ffn_layers
        from ..hf.evaluate import end_to_end_figures
        from ..hf.metrics import _NLL, Agreement, ErrorStats
        from .candidates import quantize_layer
        from .moe import Routed

        v = self._verification()
        m, n = v.model, len(v.model.layers)
        start, states = self._resume(chosen, n)
        stream = states[start - 1].copy("quantized-evaluation") if start else v.embedded.copy("quantized-evaluation")
        quantized = [j for j in self.planned if chosen[j] != "fp32"]
        kept = {key: q for key, q in self._quantized.items() if key[0] in quantized and chosen[key[0]] == key[1]}
        self._quantized.clear()  # what this round does not use is freed before it quantizes anything
        offered = {j for j in quantized if j >= start and (j, chosen[j]) not in kept and (j, chosen[j]) in self._offered}
        # the layers calling one FFN (its weights shared) compute with one quantization of it, by (its first layer,
        # recipe): the last round's where it kept one, else made at the first of its calls this round quantizes
        # (calls that compute differently, Zamba 2's, are each quantized through their own FFN, from every call's
        # kept rows' statistics merged: `per_call`)
        shared = {j: g for g in self.info.shared_groups() for j in g}
        differ = self.info.calls_differ()
        made: dict[tuple[int, str], Any] = {} if differ else {
            (shared[j][0], name): q for (j, name), q in kept.items() if j in shared}
        per_calls: dict[tuple[int, str], dict[int, Any]] = {}  # calls that differ: their quantizations, by layer
        fresh, making = [], set()
        for j in quantized:
            if j < start or (j, chosen[j]) in kept or j in offered:
                continue
            key = (shared[j][0], chosen[j]) if j in shared and not differ else None
            if key is not None and (key in made or key in making):
                continue  # a later call: the one quantization of its FFN
            making.add(key)
            fresh.append(j)
        alone = [j for j in fresh if not (differ and j in shared)]  # read here one by one, in order
        ffns = iter_ffn_layers(self.info, alone, allow_pickle=self.allow_pickle) if alone else iter(())

        def per_call(j: int) -> Any:
            """Layer j's quantization, one of its FFN's calls that differ: every call made once, together."""
            key = (shared[j][0], chosen[j])
            if key not in per_calls:
                per_calls[key] = self._calls_quantized(shared[j], by_name[chosen[j]])
            return per_calls[key].pop(j)

        keep_states = self._keeps_states(stream, n)
        for j in range(n):
            q = kept.pop((j, chosen[j]), None) if j in quantized else None
            if j < start:  # the last round's stream after this layer is this round's: its FFN stays for the next
                if q is not None:
                    self._quantized[(j, chosen[j])] = q
                self.progress(f"verify: L{j} (as the last round)", j + 1, n)
                continue
            if j in offered:
                q = self._computed(self._offered[(j, chosen[j])])
            elif j in fresh and differ and j in shared:
                q = self._computed(per_call(j))
            elif j in fresh:
                layer, calib, held = self._layer(j, ffns)
                if j in shared:  # one FFN several layers call: quantized once, from every call's inputs
                    calls = [self.ffn_calib.get(k) for k in shared[j]]
                    calib = Routed.cat(calls) if j in self.moe else torch.cat(calls)
                q = quantize_layer(layer, by_name[chosen[j]], calib, held, bins=self.settings.bins, measure=False)[0]
                del layer, calib, held
                q = self._computed(q)
                if j in shared:
                    made[(shared[j][0], chosen[j])] = q
            elif q is None and j in quantized and j in shared:
                q = made[(shared[j][0], chosen[j])]
            if q is not None and self.resident:
                self._quantized[(j, chosen[j])] = q
            with m.layer(j, ffn=q is None):
                m.run(j, stream, v.calls, ffns=self._replacements(j, q) if q is not None else None)
            del q
            m.release()
            if keep_states:
                states[j] = stream.copy(f"after-L{j}")  # shares the tensors the next layer replaces
            self.progress(f"verify: L{j}", j + 1, n)
        self._last_round = (dict(chosen), states) if keep_states else None

        def figures(base, lo, hi):
            hidden, nll, agreement = ErrorStats(), _NLL(), Agreement()
            for b in range(lo, hi):
                got, logits = m.head_out(stream.get(b), reuse=True)  # read before the next batch's
                hidden.update(v.final.get(b), got)
                agreement.update(v.references[b], logits, self.eval_ids[b], nll_into=nll)
                del logits
            return end_to_end_figures(base, hidden, nll, {}, agreement)["end_to_end"]

        domains = {label: figures(v.domain_baselines[label], lo, hi) for label, lo, hi in self.domains}
        m.release_logits()
        stream.clear()
        return domains

    def _computed(self, q: Any) -> Any:
        """A quantized FFN as the rounds' engine computes it: in the plan's dtype (`deploy.precision.in_dtype`)."""
        if self.dtype is torch.float32:
            return q
        from ..deploy.precision import in_dtype

        return in_dtype(q, self.dtype)

    def _calls_quantized(self, calls: tuple[int, ...], recipe: Recipe) -> dict[int, Any]:
        """Every call of an FFN whose calls differ (Zamba 2's) quantized under `recipe` through its own FFN, from
        every call's kept search rows' statistics merged (`hf.layers.quantize_layers`): {layer: QuantizedFFN}."""
        from ..hf.checkpoint import iter_ffn_layers
        from ..hf.inputs import LayerInputs
        from ..hf.layers import quantize_layers

        layers = list(iter_ffn_layers(self.info, list(calls), allow_pickle=self.allow_pickle))
        calib = {layer.label: self.ffn_calib.get(layer.index) for layer in layers}
        held = {layer.label: self.ffn_eval.get(layer.index)[:1] for layer in layers}  # not measured: one row
        inputs = LayerInputs(calib, held, "search", "held-out", "", {})
        out = {}
        for layer, outcome in zip(layers, quantize_layers(layers, [recipe], inputs, bins=self.settings.bins)):
            out[layer.index] = outcome.result.qmodel
        return out

    def _resume(self, chosen: Mapping[int, str], n: int) -> tuple[int, dict[int, Any]]:
        """(the first layer this round computes, the last round's stream after each layer before it): the first
        planned layer whose choice differs from the last round's (0 without a kept last round)."""
        if self._last_round is None:
            return 0, {}
        last, states = self._last_round
        self._last_round = None
        changed = [j for j in self.planned if last.get(j) != chosen.get(j)]
        start = min(changed) if changed else n
        start = min(start, n - 1)  # the last layer is always run: its stream is what the figures read
        if start and start - 1 not in states:
            return 0, {}
        return start, {j: states[j] for j in range(start)}

    def _keeps_states(self, stream: Any, n: int) -> bool:
        """Whether this round keeps its stream after each layer for the next: in memory, and the layers' states
        within a quarter of the memory available (a few hundred MB for a 270M model's 8k held-out tokens)."""
        if not self.resident or stream.folder is not None:
            return False
        from ..infra.resources import available_memory

        per_layer = sum(int(t.numel()) * t.element_size() for t in stream.items.values() if torch.is_tensor(t))
        return per_layer * n <= (available_memory() or 0) // 4

    def verification_baselines(self) -> dict[str, Any]:
        """The held-out baseline {perplexity: None, n_tokens, domains: {label: figures}}: the float model's
        perplexities the verification rounds are measured against, in the plan's dtype."""
        v = self._verification()
        return {"perplexity": None, "n_tokens": sum(int(b.numel()) for b in self.eval_ids),
                "domains": v.domain_baselines}

    def _verification(self) -> "_Verification":
        """What the verification rounds run on: this source's own engine, the held-out text's embedded stream and
        per-layer calls, and the float figures; or, for a plan verified in another dtype, the same text through an
        engine computing in it, with the float model's figures in that dtype (`_low_precision`, once)."""
        if self.dtype is torch.float32:
            return _Verification(self.model, self.embedded, self.ecalls, self.final[1], self.references,
                                 self.domain_baselines)
        if self._low is None:
            t = time.perf_counter()
            self._low = self._low_precision()
            self.timings["low_precision_baseline_s"] = time.perf_counter() - t
        return self._low

    def _low_precision(self) -> "_Verification":
        from ..hf.metrics import _NLL, reference_batch
        from ..hf.stream import SequentialModel

        m = SequentialModel(self.info, resident=self.resident, allow_pickle=self.allow_pickle, dtype=self.dtype)
        name = str(self.dtype).removeprefix("torch.")
        store = self._store(f"{name}-evaluation")
        calls = m.embed(self.eval_ids, store, self.progress, f"embed the held-out text ({name})")
        m.offload(m.embedding)
        embedded = store.copy(f"{name}-evaluation-embedded")
        n = len(m.layers)
        for j in range(n):
            with m.layer(j):
                m.run(j, store, calls)
            self.progress(f"the float model in {name}: L{j}", j + 1, n)
        final = self._store(f"{name}-final-evaluation")
        references = []
        nll = {label: _NLL() for label, _, _ in self.domains}
        domain_of = [label for label, lo, hi in self.domains for _ in range(lo, hi)]
        for b, ids in enumerate(self.eval_ids):
            hidden, logits = m.head_out(store.get(b))
            final.put(b, hidden)
            nll[domain_of[b]].update(logits, ids)
            references.append(reference_batch(logits, ids))
        store.clear()
        domains = {label: {"perplexity": nll[label].perplexity,
                           "n_tokens": sum(int(b.numel()) for b in self.eval_ids[lo:hi])}
                   for label, lo, hi in self.domains}
        return _Verification(m, embedded, calls, final, references, domains)


@dataclass
class _Verification:
    """An engine and what a verification round reads: the held-out text's embedded stream and per-layer calls, the
    float model's final hidden states and next-token figures, and its perplexity on each domain."""

    model: Any
    embedded: Any
    calls: Any
    final: Any
    references: list
    domain_baselines: dict[str, dict[str, Any]]
