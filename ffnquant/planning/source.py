"""What `make_plan` reads from the model, through the one engine (`hf.stream.SequentialModel`): the model resident,
or read a decoder layer at a time when it does not fit (`hf.memory.plan_memory` with `plan_needs`), in passes over
the layers:

1. Forward: the search and held-out texts embedded and run through each layer in turn; each layer's FFN inputs
   kept (the candidates' data), and the search text's input to each decoder layer (for the backward pass). On
   the way each layer's FFN is checked to reproduce the model's module, and where its input scale can fold
   (`SequentialModel.fold_sites`). The final norm and LM head give the float figures: perplexities, final hidden
   states, the probe tokens' next-token distributions, and the loss gradient at the last layer's output.
2. Backward, last layer to first (`gradients.GradientPass`): each layer recomputed on its kept input with the
   gradient probe at its FFN's output, the gradient at its output carried back to its input. The FFN output
   gradients are those of one backward pass through the whole model: the same operations on the same values.
3. Forward, scoring: each layer's candidates scored on its kept inputs (`make_plan` hands them to the executor),
   and each probe's ablation started as a stream of the probe tokens from that layer on, its FFN replaced; the
   streams already started pass each layer with its float FFN. The head measures every stream at the end.
4. Each verification round: the held-out text through every layer quantized as chosen, scored against the float
   figures (`rounds.VerificationRounds`, which this class takes its rounds from).

Kept tensors go to a temporary folder, a file per layer or batch, when the memory plan spills.
tests/test_plan_source.py checks that every mode gives the same plan and figures.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..hf.memory import Needs
from ..hf.metrics import TOP_K
from .scores import SCORE_ROWS, held_rows
from .moe import MoELayer, QuantizedMoE, Routed
from .gradients import GradientPass
from .rounds import VerificationRounds

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..spec import FFNSpec

__all__ = ["PlanSource", "plan_needs", "CHECK_TOKENS"]

CHECK_TOKENS = 128  # the leading tokens of the search text's first sequence the structural checks run on

Progress = Callable[[str, int, int], None]


def _scoring_bytes(spec: FFNSpec, tokens: int) -> int:
    """A candidate's quantization of one FFN on `tokens` inputs: the FFN x 11 (its copies, the onnxruntime floor's
    export and sessions), the activations of its sites, GPTQ's float64 input Hessians."""
    d, d_ff = spec.d_model, spec.d_ff
    return 11 * spec.n_params * 4 + (2 * d + 3 * d_ff) * tokens * 4 + 8 * (d * d + d_ff * d_ff)


def plan_needs(info: ModelInfo, *, calib_tokens: int, eval_tokens: int, probe_tokens: int, batch_tokens: int,
               dtype: torch.dtype = torch.float32):
    """What `make_plan` holds beside the model's weights (an `hf.memory.Needs` for `hf.memory.plan_memory`);
    verified in a low-precision `dtype`, also the second engine's streams and, resident, its model."""
    spec, n = info.spec, info.n_layers
    d, d_ff, vocab = spec.d_model, spec.d_ff, int(info.config.get("vocab_size") or 0)
    c, e, p = calib_tokens, eval_tokens, min(probe_tokens + batch_tokens, calib_tokens)  # whole batches of probes
    # kept per layer: search FFN inputs, gradients, decoder-layer inputs (until the backward pass has used them),
    # the probe tokens' decoder-layer inputs and two ablation streams; held-out FFN inputs. Per text: the running
    # stream, its embedding (each round starts there), its final hidden states, a quantized stream.
    calibration = (n * (3 * c + 3 * p) + 4 * c) * d * 4
    evaluation = (n + 4) * e * d * 4
    low = 0 if dtype is torch.float32 else torch.finfo(dtype).bits // 8
    # the verification engine in `dtype`: per text its embedded copy, the running stream and the final states
    evaluation += 3 * (c + e) * d * low
    # the probe tokens' float next-token log-probabilities, and every token's kept float figures (hf.metrics.Reference:
    # NLL, top-k log-probabilities and ids; the final hidden states are counted per text above): always in memory
    logp = p * vocab * 4 + (c + e) * (8 + 8 * TOP_K)
    return Needs(calibration, evaluation, logp, {"a candidate's quantization": _scoring_bytes(spec, c + e)},
                 {"its FFN inputs": (c + e) * d * 4, "a backward pass through it": 2 * batch_tokens * (8 * d + 4 * d_ff) * 4},
                 batch_tokens, "--calib-tokens/--eval-tokens/--probe-tokens",
                 # resident, every layer is scored at once: a float copy of each FFN and its two probes' quantized
                 # copies wait for their ablations (in host memory); the verification engine's model in `dtype`
                 # beside the resident one (where the engine computes)
                 resident_extra=3 * len(info.layers) * spec.n_params * 4, resident_models=info.n_params_total * low)


@contextlib.contextmanager
def _routed(experts: Any, sink: dict[str, list]):
    """While active, each call of an experts module appends what it receives (tokens, experts, routing weights) as
    a `planning.moe.Routed` to `sink["routed"]`."""
    def hook(module, args, kwargs):  # returns None: the call's arguments stay as they are
        from ..hf.routed import routed_rows

        # every row, as the module computes it (Llama 4's stacked rows keep their zero rows: tokens not routed to
        # that expert compute nothing, float or quantized), so the rows stay those of the gradients at its output
        x, index, weights = routed_rows(module, args, kwargs)
        sink.setdefault("routed", []).append(Routed(x.detach().float(), index.detach(), weights.detach().float()))

    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _nbytes(module: Any) -> int:
    """The bytes of a module's tensors and of what its `linears` hold beside them (a QuantizedFFN's codes)."""
    seen, total = set(), 0
    tensors = list(module.state_dict().values()) if hasattr(module, "state_dict") else []
    for ql in (getattr(module, "linears", None) or {}).values():
        tensors += [v for v in vars(ql).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class PlanSource(GradientPass, VerificationRounds):
    """What `make_plan` reads from the model (see the module docstring), the model `resident` or read a decoder
    layer at a time; a context manager (its temporary folder, when spilling, is removed on exit). Passes 1 and 2
    run on entry."""

    def __init__(self, info: ModelInfo, settings: Any, text: Any, eval_text: Any, probe_tokens: int, resident: bool,
                 spill: bool, progress: Progress | None, timings: dict[str, float], allow_pickle: bool = False,
                 dtype: torch.dtype = torch.float32, offer_budget: int | None = None) -> None:
        self.info, self.settings, self.text, self.eval_text = info, settings, text, eval_text
        self.dtype, self._low = dtype, None
        self.probe_tokens, self.resident, self.spill, self.allow_pickle = probe_tokens, resident, spill, allow_pickle
        self.progress, self.timings = progress or (lambda *a: None), timings
        self.ablations: dict[tuple[int, str], Any] = {}
        # resident: each verification round's quantized FFNs, by (layer, recipe), for the next round to reuse
        # (the rounds change few layers; the quantizers are deterministic, so a kept FFN is the one made again)
        self._quantized: dict[tuple[int, str], Any] = {}
        # resident: the quantized FFNs the candidate scoring made that a round may choose (`offer`), kept for every
        # round; the same FFNs `quantize_layer` makes again, so a round quantizes only what was not kept
        self._offered: dict[tuple[int, str], Any] = {}
        self._offer_budget: int | None = offer_budget  # bytes; None: a quarter of what is free at the first offer
        # the layers calling one FFN (its weights shared): quantized from all their calls' rows, never as scored
        # (where its calls compute differently, Zamba 2's adapters, each through its own FFN from every call's
        # statistics merged, `rounds`; a recipe whose calibration cannot merge so is left out there)
        differ = info.calls_differ()
        self._shared_calls = {j for calls in info.shared_groups() for j in calls}
        self.per_call_refusals: dict[int, str] = {
            j: (f"layers {', '.join(f'L{k}' for k in calls)} call one FFN each with its own adapters, and ffnquant "
                "merges only range histograms and GPTQ's Hessians across such calls")
            for calls in (info.shared_groups() if differ else ()) for j in calls}
        # the layers whose loss gradients stay after the scoring pass (`gradients`): candidates scored later there
        self.keep_gradients: set[int] = set()
        # resident: the last round's choice and its held-out stream after each layer, so that the next round starts
        # at the first layer it changes (rounds differ in a few layers; the stream before them is the same)
        self._last_round: tuple[dict[int, str], dict[int, Any]] | None = None

    def __enter__(self) -> "PlanSource":
        from ..hf.spill import spill_folder

        self._exit = contextlib.ExitStack()
        self.folder = self._exit.enter_context(spill_folder(self.spill, None))  # in the temporary directory
        try:
            t = time.perf_counter()
            self._forward()
            self.timings["capture_s"] = time.perf_counter() - t
            t = time.perf_counter()
            self._backward()
            self.timings["gradients_s"] = time.perf_counter() - t
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._offered.clear()
        self._last_round = None
        self._exit.close()

    def _store(self, name: str):
        from ..hf.spill import Store

        return Store(self.folder, name)

    # --- pass 1 -----------------------------------------------------------------------------------------------

    def _forward(self) -> None:
        from ..hf.capture import load_tokenizer, text_label
        from ..hf.checkpoint import iter_ffn_layers
        from ..hf.inputs import domain_budgets, domain_spans, eval_domain_batches, token_budget
        from ..hf.metrics import _NLL, reference_batch
        from ..hf.stream import SequentialModel, token_batches_of
        from .sensitivity import _ffn_modules, _nll_sum, float_terms, probe_batches, probe_vocabulary

        info, settings = self.info, self.settings
        self.calib_ids = token_batches_of(info, self.text, "calibration", settings, settings.max_calib_tokens)
        # the held-out domains as the in-memory path reads them (hf.inputs.capture_layer_inputs(by_domain=True))
        domains = eval_domain_batches(info, load_tokenizer(info.path), self.eval_text, settings,
                                      settings.max_eval_tokens, True)
        self.eval_ids = [b for _, batches in domains for b in batches]
        self.domains = domain_spans(domains)
        cal_name, ev_name = text_label(self.text, "calibration"), " + ".join(label for label, _ in domains)
        self.texts = {"calibration": cal_name, "evaluation": ev_name, "token_budgets": {
            "calibration": token_budget("calibration", settings.max_calib_tokens, self.calib_ids, cal_name),
            **domain_budgets(domains, settings.max_eval_tokens, True, ev_name)}}
        # the probe tokens: the search text's leading whole sequences (their own batches, their own calls)
        self.probe_ids, self.n_probe = probe_batches(self.calib_ids, self.probe_tokens)
        self.n_probe_batches = len(self.probe_ids)
        # the loss gradients are taken on the search text's leading whole batches that hold the rows a candidate's
        # error is summed over (`candidates.SCORE_ROWS`) and the probe tokens: the head's forward and backward pass
        # and the layer-by-layer backward pass run on those alone (the quantizers calibrate on every batch). At a
        # 262k vocabulary the head is most of a pass.
        self.n_grad_batches = len(probe_batches(self.calib_ids, max(SCORE_ROWS, self.n_probe))[0])
        m = self.model = SequentialModel(info, resident=self.resident, allow_pickle=self.allow_pickle,
                                             fast_head=True)  # figures compared with each other (`infra.blas`)
        # the module whose output is each layer's FFN output (an FFN of Linears in the block: its second Linear; a
        # layer of routed experts: its experts module, the weighted sum); the layers a plan covers
        self.outputs = _ffn_modules(m.model, info, info.layers)
        # where each layer of routed experts is handed its rows: the experts module, or (experts' matrices as child
        # modules, JetMoE's) its first matrix's module
        self.routed_in = _ffn_modules(m.model, info, info.layers, inputs=True) if info.n_experts else {}
        self.planned = [j for j in range(len(m.layers)) if m.groups[j]]
        self.moe = {j for j in self.planned if m.groups[j][0].expert is not None}
        self.fold_refusals: dict[int, str] = {}  # layer index -> why an input scale cannot fold there
        ffns = iter_ffn_layers(info, "all", allow_pickle=self.allow_pickle)
        calib, evals = self._store("calibration"), self._store("evaluation")
        self.ccalls = m.embed(self.calib_ids, calib, self.progress, "embed the search text")
        embedded = self._store("probe-embedded")
        self.pcalls = m.embed(self.probe_ids, embedded)  # only the calls: the states come from `calib`
        embedded.clear()
        # the structural checks (ffnquant's FFN reproduces the layer's, where an input scale folds) run each dense
        # layer on the leading `CHECK_TOKENS` of the search text's first sequence alone: they compare outputs to a
        # relative bound, which 128 x d_model values show as well as a batch, at a fraction of the layer runs (four
        # runs a layer: 4 s of a 270M model's plan on its 512-token sequences)
        checked = self._store("check")
        kcalls = m.embed([self.calib_ids[0][:1, :CHECK_TOKENS]], checked)
        self.ecalls = m.embed(self.eval_ids, evals, self.progress, "embed the held-out text")
        m.offload(m.embedding)
        # a plan verified in float32 reads the held-out figures of this pass (each round starts from the embedded
        # stream); one verified in another dtype reads those of an engine computing in it (`_low_precision`)
        float_rounds = self.dtype is torch.float32
        self.embedded = evals.copy("evaluation-embedded") if float_rounds else None
        self.block_in: dict[int, Any] = {}
        self.ffn_calib, self.ffn_eval = self._store("ffn-calibration"), self._store("ffn-evaluation")
        n = len(m.layers)
        for j in range(n):
            self.block_in[j] = calib.copy(f"block{j}")
            cal_x: dict[str, list[torch.Tensor]] = {}
            ev_x: dict[str, list[torch.Tensor]] = {}
            hfs = [next(ffns) for _ in m.groups[j]]
            moe = j in self.moe
            # routed experts are checked on the whole first batch: one sequence reaches few of them
            where = (calib, self.ccalls) if moe else (checked, kcalls)
            with m.layer(j):
                m.check(j, *where, hfs)
                self.fold_refusals.update({layer.index: site.refusal for layer, site in m.fold_sites(j, *where).items()
                                           if site.refusal})
                m.run(j, checked, kcalls)
                if moe:  # what the experts module receives: the tokens, their experts and routing weights
                    with _routed(self.routed_in[j], cal_x):
                        m.run(j, calib, self.ccalls)
                    with _routed(self.routed_in[j], ev_x):
                        m.run(j, evals, self.ecalls)
                else:
                    m.run(j, calib, self.ccalls, capture=cal_x if hfs else None)
                    m.run(j, evals, self.ecalls, capture=ev_x if hfs else None)
            if moe:
                self.ffn_calib.put(j, Routed.cat(cal_x["routed"]).to_dict())
                self.ffn_eval.put(j, Routed.cat(ev_x["routed"]).to_dict())
            elif hfs:
                label = m.groups[j][0].label
                self.ffn_calib.put(j, torch.cat(cal_x[label]))
                self.ffn_eval.put(j, held_rows(torch.cat(ev_x[label])))
            del cal_x, ev_x, hfs
            self.progress(f"search and held-out texts: L{j}", j + 1, n)
        # the float figures; the loss gradient at the last layer's output
        self.final = (self._store("final-calibration"), self._store("final-evaluation"))
        self.grad_out = self._store("gradient")
        nll_eval = {label: _NLL() for label, _, _ in self.domains}
        domain_of = [label for label, lo, hi in self.domains for _ in range(lo, hi)]
        self.references: list = []  # each held-out batch's float next-token figures (`Reference`)
        # the probe batches' float figures (`float_terms`)
        self.ref: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # per probe batch, the tokens its ablations' next-token distributions are taken over (`probe_vocabulary`)
        self.probe_vocab: list[torch.Tensor] = []
        for b, ids in enumerate(self.calib_ids[: self.n_grad_batches]):
            if m.replay:  # the gradients come from the whole forward's backward pass (`_backward_whole`)
                final, logits = m.head_out(calib.get(b))
            else:
                final, logits, grad = m.head_grad(calib.get(b), lambda logits, ids=ids: _nll_sum(logits, ids))
                self.grad_out.put(b, grad)
            if b < self.n_probe_batches:  # what the probes' ablations are measured against
                self.final[0].put(b, final)
                k = self.probe_ids[b].shape[0]
                vocab = probe_vocabulary(logits[:k], ids[:k])
                self.probe_vocab.append(vocab)
                self.ref.append(float_terms(logits[:k, :, vocab], ids[:k], vocab))
        calib.clear()
        checked.clear()
        # the held-out figures only where the rounds read them: the head at a 262k vocabulary is most of a pass
        for b, ids in enumerate(self.eval_ids if float_rounds else ()):
            final, logits = m.head_out(evals.get(b), reuse=True)  # read before the next batch's
            self.final[1].put(b, final)
            ref = reference_batch(logits, ids)
            nll_eval[domain_of[b]].add(ref.nll)  # its NLLs, not computed again
            self.references.append(ref)
            del logits
        m.release_logits()
        evals.clear()
        self.domain_baselines = {label: {"perplexity": nll_eval[label].perplexity,
                                         "n_tokens": sum(int(b.numel()) for b in self.eval_ids[lo:hi])}
                                 for label, lo, hi in self.domains} if float_rounds else {}

    # --- pass 3 -----------------------------------------------------------------------------------------------

    def groups(self):
        """The layers to score as groups of (layer, search inputs, held-out inputs, loss gradients): all layers in
        one group when the model is resident (an executor gets every layer's tasks at once), else one layer at a
        time as the stream reaches it. The probes' ablations handed over by `ablate` are run from their layer on,
        the streams passing the layers in order, and measured at the end: the same operations either way."""
        from ..hf.checkpoint import iter_ffn_layers
        from .sensitivity import Ablation, ablation_terms, predicted_tokens

        m, n = self.model, len(self.model.layers)
        calls = self.pcalls
        streams: dict[tuple[int, str], Any] = {}
        self._pending: list[tuple[int, str, Any]] = []
        ffns = iter_ffn_layers(self.info, "all", allow_pickle=self.allow_pickle)

        def group(js):
            return [(*self._layer(j, ffns), self.grads.get(j)) for j in js]

        def advance(j: int) -> None:  # the ablations started before layer j pass it float; j's own start there
            if streams:
                with m.layer(j):
                    for store in streams.values():
                        m.run(j, store, calls)
            mine = [(name, q) for i, name, q in self._pending if i == j]
            if mine:  # this layer's probes, each in its FFN's place
                with m.layer(j, ffn=False):
                    for name, q in mine:
                        streams[(j, name)] = store = self.block_in[j].copy(f"ablation{j}-{len(streams)}")
                        m.run(j, store, calls, ffns=self._replacements(j, q))
            self._pending = [p for p in self._pending if p[0] != j]
            if j in self.planned and j not in self.keep_gradients:
                self.grads.pop(j)
            self.block_in.pop(j).clear()
            m.release()
            if streams:
                self.progress(f"probe ablations: streams through L{j}", j + 1, n)

        if self.resident:
            yield group(self.planned)
            for j in range(n):
                advance(j)
        else:
            for j in range(n):
                if j in self.planned:
                    yield group([j])
                advance(j)
        tokens = predicted_tokens(self.probe_ids)
        for k, ((j, name), store) in enumerate(streams.items()):
            terms = []
            for b, ids in enumerate(self.probe_ids):
                hidden, logits = m.head_out(store.get(b), vocab=self.probe_vocab[b])
                terms.append(ablation_terms(logits, hidden, ids, *self.ref[b],
                                            self.final[0].get(b)[: ids.shape[0]], self.probe_vocab[b]))
            self.ablations[(j, name)] = Ablation.of(j, terms, tokens)
            store.clear()
            self.progress("probe ablations: the final norm and head", k + 1, len(streams))

    def _layer(self, j: int, ffns) -> tuple[Any, Any, Any]:
        """Layer j as the candidates take it, with its search and held-out inputs: an FFN (`HFLayer`) and its input
        rows, or a layer of routed experts (`planning.moe.MoELayer`) and what its experts module received."""
        if j in self.moe:
            return (MoELayer([next(ffns) for _ in self.model.groups[j]]), Routed(**self.ffn_calib.get(j)),
                    Routed(**self.ffn_eval.get(j)))
        return next(ffns), self.ffn_calib.get(j), self.ffn_eval.get(j)

    def layer_inputs(self, j: int) -> tuple[Any, Any, Any]:
        """Layer j (an FFN of the plan) with its kept search and held-out inputs, read again after the scoring
        pass (what the onnxruntime floor measures, `floor.FloorSearch`)."""
        from ..hf.checkpoint import iter_ffn_layers

        return self._layer(j, iter_ffn_layers(self.info, [j], allow_pickle=self.allow_pickle))

    def release_gradients(self) -> None:
        """Free the loss gradients kept for candidates scored later (`keep_gradients`): the search is done."""
        for j in self.keep_gradients:
            if j in self.grads.items:
                self.grads.pop(j)
        self.keep_gradients = set()

    def gradients(self, j: int) -> Any:
        """The loss gradients at layer j's FFN output on its search inputs, kept after the scoring pass for a layer of
        `keep_gradients` (what a candidate scored later reads, `floor.FloorSearch`)."""
        return self.grads.get(j)

    def _replacements(self, j: int, q: Any) -> dict[str, Any]:
        """What computes in layer j's FFNs' place, by label: a quantized FFN, or each quantized expert."""
        if not isinstance(q, QuantizedMoE):
            return {self.model.groups[j][0].label: q}
        # by this layer's labels: a later call of experts called again computes with its first call's quantization
        mine = {layer.expert: layer.label for layer in self.model.groups[j]}
        return {mine[e]: ffn for e, ffn in q.qffns.items()}

    def ablate(self, layer: Any, name: str, ffn: Any) -> None:
        """Layer `layer`'s probe `name` measured with `ffn` in its FFN's place (its stream starts at its layer)."""
        self._pending.append((layer.index, name, ffn))

    def offer(self, index: int, name: str, ffn: Any) -> None:
        """Layer `index`'s FFN quantized under recipe `name`, as scored: the verification rounds use it instead of
        quantizing it again (resident models only: a streamed model keeps nothing beyond its layer; not an FFN several
        layers call)."""
        if not self.resident or index in self._shared_calls:
            return  # a shared FFN is quantized from every call's inputs, not one call's as scored (`rounds.verify`)
        size = _nbytes(ffn)
        if self._offer_budget is None:
            from ..infra.resources import available_memory

            # a quarter of the memory free now: what the rounds would otherwise make again is not worth more
            self._offer_budget = (available_memory() or 0) // 4
        if size <= self._offer_budget:
            self._offer_budget -= size
            self._offered[(index, name)] = ffn
