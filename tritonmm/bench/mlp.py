"""The MLP-block benchmark: transformers' ``LlamaMLP`` in bf16, eager against ``tritonmm.fuse``.

For each config and token count M, alternated round by round in one process (medians of wall time
between ``torch.cuda.synchronize()`` calls, as in :mod:`tritonmm.bench.model`):

* ``eager``: the module as transformers runs it (gate, up, SiLU, product, down: five kernels);
* ``fused``: the same module after :func:`tritonmm.fuse` (the gated GEMM kernel, then down, up to
  ``gated.GATED_MAX_M`` rows or ``gated.KERNEL_MAX_FLOPS_NO_GRAD``; above, one cuBLAS GEMM on the packed gate
  and up weights, one Triton pass for SiLU and the product, then down);
* ``unpacked``: ``fuse(..., pack=False)``: above 16 rows, two cuBLAS projections where
  ``gated.PRODUCT_MIN_FLOPS_NO_GRAD`` allows, else the module's own forward;
* ``kernel``: the gated GEMM kernel at any M (up to ``gated.GATED_MAX_M`` rows the one on separate weights, above
  it the one on the packed weights, :mod:`tritonmm.kernels.gated_packed`), then the down GEMM;
* ``bound``: cuBLAS on x @ [Wg; Wu]^T and the down GEMM, no elementwise pass: what a perfect fused
  kernel at cuBLAS speed would take;
* ``compile``: ``torch.compile`` of the module (SiLU and the product fused by Inductor, GEMMs on cuBLAS);
* ``again``: a copy of the eager module, the A/A control: its ratio's spread over the rounds (``again_low`` /
  ``again_high``, the 10th and 90th percentiles of the per-round ratio) is the noise any other ratio sits in.

Forward under ``no_grad``; forward + backward (eager, fused and unpacked, a fixed upstream gradient) for
M >= 512, with each path's peak memory above what its parameters, gradients and input already hold
(``torch.cuda.max_memory_allocated`` over one forward + backward after a first one allocated the gradients) and
the activation memory its forward keeps for the backward (``*_saved_mib``, :func:`saved_bytes`).
Ratios are eager time / contender time (> 1: faster than eager); ``fused_vs_compile`` is compile / fused.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

import torch

from .model import alternate

CONFIGS = {"llama3-8b": (4096, 14336), "tinyllama": (2048, 5632), "small": (1024, 2816)}
"""hidden / intermediate: Llama-3-8B's and TinyLlama's MLPs, and that of the model benchmark's small config."""
TOKENS = (1, 16, 512, 4096, 16384)
TRAIN_MIN_M = 512


def _mlp(hidden: int, inter: int, device, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")).to(dtype)


def _ratios(times: dict, base: str, again: str | None = None) -> dict:
    out = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        if k != base:
            out[f"{k}_ratio"] = statistics.median(b / x for b, x in zip(times[base], v))
    if again is not None:  # the A/A control's per-round spread
        per_round = sorted(b / x for b, x in zip(times[base], times[again]))
        q = statistics.quantiles(per_round, n=10, method="inclusive")
        out[f"{again}_low"], out[f"{again}_high"] = q[0], q[-1]
    return out


def _peak_memory(runs: dict, base: str) -> dict:
    """Each run's peak memory (MiB) above what was allocated before it, the gradients allocated by a first call;
    and its ratio to ``base``'s (< 1: less memory than ``base``)."""
    out = {}
    for name, (_, fn) in runs.items():
        fn()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        out[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    for name in runs:
        if name != base:
            out[f"{name}_peak_vs_{base}"] = out[f"{name}_peak_mib"] / out[f"{base}_peak_mib"]
    return out


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of the graph ``fn()`` records (through
    ``torch.autograd.graph.saved_tensors_hooks``), leaving out those of the tensors in ``exclude`` (the parameters
    and the input, which exist anyway): the activation memory a layer holds from its forward to its backward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(kept.values())


def _saved_memory(modules: dict, x, base: str) -> dict:
    """Each module's activation memory kept for the backward (MiB, :func:`saved_bytes`) and its ratio to ``base``'s."""
    out = {f"{name}_saved_mib": saved_bytes(lambda m=m: m(x), (*m.parameters(), x)) / 2**20
           for name, m in modules.items()}
    for name in modules:
        if name != base:
            out[f"{name}_saved_vs_{base}"] = out[f"{name}_saved_mib"] / max(out[f"{base}_saved_mib"], 1e-9)
    return out


def run(device, rounds: int = 15, configs=None, tokens=None, progress=print) -> list[dict]:
    """One row per (config, M): forward times and ratios, and forward + backward for M >= 512."""
    import tritonmm
    from tritonmm.dispatch import gated, gated_cublas

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    none = contextlib.nullcontext
    for name in configs or list(CONFIGS):
        hidden, inter = CONFIGS[name]
        mlp = _mlp(hidden, inter, device, dtype)
        again = copy.deepcopy(mlp)
        fused = tritonmm.fuse(copy.deepcopy(mlp))
        unpacked = tritonmm.fuse(copy.deepcopy(mlp), pack=False)
        compiled = torch.compile(copy.deepcopy(mlp), dynamic=True) if device.type == "cuda" else None
        w_cat = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        w_down = mlp.down_proj.weight.detach()

        def kernel(x):  # a gated GEMM kernel at any M, then down
            if x.shape[0] > gated.GATED_MAX_M and gated_cublas.packed_kernel_serves(x, w_cat, False, any_size=True):
                h = gated_cublas.packed_kernel(x, w_cat, "silu")
            else:
                wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
                h = gated.forward(x, wg, wu, None, None, "silu", False, kernel=gated.choose_kernel(x, wg, wu))[0]
            return torch.nn.functional.linear(h, w_down)

        def bound(x):
            return torch.nn.functional.linear(torch.nn.functional.linear(x, w_cat)[:, :inter], w_down)

        for M in tokens or TOKENS:
            progress(f"mlp {name}: M = {M}")
            x = torch.randn(M, hidden, device=device, dtype=dtype)
            runs = {"eager": (none, lambda: mlp(x)), "again": (none, lambda: again(x)),
                    "fused": (none, lambda: fused(x)),
                    "unpacked": (none, lambda: unpacked(x)), "bound": (none, lambda: bound(x)),
                    "kernel": (none, lambda: kernel(x))}
            if compiled is not None:
                runs["compile"] = (none, lambda: compiled(x))
            with torch.no_grad():
                times = alternate(runs, device, rounds, iters=1, warmup=3)
            row = {"config": name, "hidden": hidden, "intermediate": inter, "tokens": M,
                   **_ratios(times, "eager", "again")}
            if "compile_ms" in row:
                row["fused_vs_compile_ratio"] = statistics.median(c / f for c, f in zip(times["compile"], times["fused"]))
            if M >= TRAIN_MIN_M:
                xg = x.clone().requires_grad_()
                grad = torch.randn(M, hidden, device=device, dtype=dtype)
                train = {"train_eager": (none, lambda: mlp(xg).backward(grad)),
                         "train_again": (none, lambda: again(xg).backward(grad)),
                         "train_fused": (none, lambda: fused(xg).backward(grad)),
                         "train_unpacked": (none, lambda: unpacked(xg).backward(grad))}
                row.update(_ratios(alternate(train, device, rounds, iters=1, warmup=2), "train_eager", "train_again"))
                if device.type == "cuda":
                    row.update(_peak_memory(train, "train_eager"))
                row.update(_saved_memory({"train_eager": mlp, "train_fused": fused, "train_unpacked": unpacked}, xg,
                                         "train_eager"))
                del xg, grad
                for m in (mlp, again, fused, unpacked):
                    m.zero_grad(set_to_none=True)
            rows.append(row)
            del x
        del mlp, again, fused, unpacked, compiled, w_cat
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_report(rows: list[dict]) -> None:
    print(f"{'config':10} {'M':>6} {'eager ms':>9} {'A/A':>12} {'fused':>7} {'unpack':>7} {'kernel':>7} {'bound':>7} "
          f"{'compile':>8} "
          f"{'f/comp':>7} {'train':>7} {'t-unp':>7} {'mem':>6} {'saved':>6}   (eager time / contender time; mem, saved: "
          "fused peak memory, activations kept for the backward / eager's)")
    for r in rows:
        get = lambda k: f"{r[k]:.3f}" if k in r else "-"  # noqa: E731
        aa = f"{r['again_low']:.3f}-{r['again_high']:.3f}" if "again_low" in r else "-"
        print(f"{r['config']:10} {r['tokens']:>6} {r['eager_ms']:>9.3f} {aa:>12} {get('fused_ratio'):>7} "
              f"{get('unpacked_ratio'):>7} "
              f"{get('kernel_ratio'):>7} {get('bound_ratio'):>7} {get('compile_ratio'):>8} "
              f"{get('fused_vs_compile_ratio'):>7} {get('train_fused_ratio'):>7} {get('train_unpacked_ratio'):>7} "
              f"{get('train_fused_peak_vs_train_eager'):>6} {get('train_fused_saved_vs_train_eager'):>6}")


def markdown(rows: list[dict]) -> str:
    """The MLP rows as a markdown table (`bench --from-json RUN.json --markdown`)."""
    lines = ["| MLP (hidden / intermediate) | tokens | eager ms | fused | fused, unpacked | gated kernel, any M | "
             "cuBLAS bound | torch.compile | fused fwd+bwd |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        get = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['config']} ({r['hidden']} / {r['intermediate']}) | {r['tokens']} | {r['eager_ms']:.3f} | "
                     f"{get('fused_ratio')} | {get('unpacked_ratio')} | {get('kernel_ratio')} | {get('bound_ratio')} | "
                     f"{get('compile_ratio')} | "
                     f"{get('train_fused_ratio')} |")
    return "\n".join(lines)
