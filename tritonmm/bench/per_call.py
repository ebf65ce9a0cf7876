"""The per-call rows of the model benchmark: the host cost of each tritonmm entry point against the torch call it
replaces, timed as many back-to-back calls of a problem whose GPU work is shorter than its host work, so that the
host sets the pace and the difference is what each call costs on the host."""

from __future__ import annotations

import copy
import statistics

import torch

from .timing import collect_young, gc_paused, wall_ms


def per_call_us(pairs: dict, device, rounds: int, calls: int) -> dict:
    """µs per call of each of two contenders, ``calls`` back-to-back calls a sample, their order reversed
    every other round (``rounds`` rounded up to an even number), Python's garbage collector paused throughout
    and its young generations collected between rounds (:func:`~tritonmm.bench.timing.gc_paused`): medians over
    rounds, and ``over``: the
    median over pairs of consecutive rounds of (second - first), averaged over the pair (each contender is
    timed once first and once second in a pair, so an effect of the place in a round cancels)."""
    for fn in pairs.values():
        for _ in range(20):
            fn()
    times = {k: [] for k in pairs}
    names = list(pairs)
    with gc_paused():
        for r in range(rounds + rounds % 2):
            collect_young()
            for k in (names if r % 2 == 0 else names[::-1]):
                times[k].append(wall_ms(pairs[k], device, calls) * 1e3)
    out = {k: statistics.median(v) for k, v in times.items()}
    first, second = times[names[0]], times[names[1]]
    out["over"] = statistics.median((second[i] + second[i + 1] - first[i] - first[i + 1]) / 2
                                    for i in range(0, len(first) - 1, 2))
    return out


def per_call_rows(device, rounds: int | None = None, calls: int = 400) -> list[dict]:
    """Host cost per call of each entry point against the torch call it replaces (x 1 x 2048, weight
    5632 x 2048, bf16 on a GPU; fp32 on the CPU), with and without autograd, F.linear against itself (an A/A row:
    the spread of the method on this host), and of a Sequential of that Linear,
    GELU and a Linear back against the same modules fused (``tritonmm.fuse``); autocast forward + backward
    with fp32 weights (512 x 2048 x 5632); a GEMM forced to the Triton pointer kernel against a bare
    launch of the same compiled kernel. ``rounds``: default 101 on a GPU (the host's jitter is a larger share
    of a call there), 41 on the CPU; the autocast row takes three times the rounds and 40 calls a sample."""
    import torch.nn.functional as F

    import tritonmm

    gpu = device.type == "cuda"
    rounds = rounds or (101 if gpu else 41)
    dtype = torch.bfloat16 if gpu else torch.float32
    K, N = (2048, 5632) if gpu else (64, 176)
    rows = []

    def add(what, base, ours, fns, rounds=rounds, calls=calls, weight=None):
        us = per_call_us(fns, device, rounds, calls)
        rows.append({"row": what, "torch": base, "tritonmm": ours, "torch_us": us[base], "tritonmm_us": us[ours],
                     "over_us": us["over"], "ratio": us[base] / (us[base] + us["over"])})
        if weight is not None:
            rows[-1]["weight_plan"] = _plan_name(weight)

    x = torch.randn(1, K, device=device, dtype=dtype)
    lin = torch.nn.Linear(K, N, device=device, dtype=dtype)
    swapped = tritonmm.swap_linear(copy.deepcopy(lin))
    w, b = lin.weight, lin.bias
    seq = torch.nn.Sequential(lin, torch.nn.GELU(), torch.nn.Linear(N, K, device=device, dtype=dtype))
    fused = tritonmm.fuse(copy.deepcopy(seq))
    for grad in (False, True):
        tag = "grad" if grad else "no_grad"
        with torch.set_grad_enabled(grad):
            add(f"nn.Linear, {tag}", "nn.Linear", "swapped", {"nn.Linear": lambda: lin(x), "swapped": lambda: swapped(x)})
            add(f"F.linear, {tag}", "F.linear", "tritonmm.linear",
                {"F.linear": lambda: F.linear(x, w, b), "tritonmm.linear": lambda: tritonmm.linear(x, w, b)}, weight=w)
            add(f"A/A, {tag}", "F.linear", "F.linear again",  # the same call twice: the method's spread
                {"F.linear": lambda: F.linear(x, w, b), "F.linear again": lambda: F.linear(x, w, b)})
            wt = w.detach().t()
            add(f"matmul, {tag}", "torch.matmul", "tritonmm.matmul",
                {"torch.matmul": lambda: torch.matmul(x, wt), "tritonmm.matmul": lambda: tritonmm.matmul(x, wt)},
                weight=wt)
            add(f"Linear + GELU + Linear, {tag}", "nn.Sequential", "fused",
                {"nn.Sequential": lambda: seq(x), "fused": lambda: fused(x)})
    if gpu:  # fp32 master weights under bf16 autocast, forward + backward
        M = 512
        x32 = torch.randn(M, K, device=device, requires_grad=True)
        lin32 = torch.nn.Linear(K, N, device=device)
        sw32 = tritonmm.swap_linear(copy.deepcopy(lin32))

        def fwd_bwd(m):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = m(x32)
            y.float().sum().backward()

        add("autocast fwd+bwd 512 x 2048 x 5632, fp32 weights", "nn.Linear", "swapped",
            {"nn.Linear": lambda: fwd_bwd(lin32), "swapped": lambda: fwd_bwd(sw32)}, rounds=3 * rounds, calls=40)
        rows.append(_triton_route_row(device, rounds, calls))
    return rows


def _plan_name(weight) -> str:
    """Which path the tritonmm calls on ``weight`` took after the timing: its weight plan
    (:mod:`tritonmm.dispatch.plans`)."""
    from tritonmm.dispatch import plans

    if not plans.planned(weight):
        return "none (keyed route)"
    free = plans.plans[id(weight)][0]
    return {2: "free for every GEMM", 1: "free in the forward only", 0: "not free (keyed route, rows kept)"}[free]


def _triton_route_row(device, rounds: int, calls: int) -> dict:
    """tritonmm.matmul forced to the pointer kernel against the same compiled kernel launched bare
    (output allocated, then one direct launch), 16 x 64 x 64 bf16."""
    import tritonmm
    from tritonmm.kernels import launchers

    a = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    b = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    with tritonmm.force_backend("triton", "pointer"):
        config = tritonmm.explain(a, b).config or None
        tritonmm.matmul(a, b)
    launch = launchers.pointer_launcher(16, 64, 64, 1, 1, (0, 0, 64, 1), (0, 0, 64, 1), (0, 0, 64, 1), a.dtype, device,
                                        config=config)

    def bare():
        out = torch.empty(16, 64, device=device, dtype=a.dtype)
        launch(a, b, out, None)

    bare()
    forced = tritonmm.force_backend("triton", "pointer", launch.state["config"])
    with forced:
        us = per_call_us({"bare launch": bare, "tritonmm.matmul": lambda: tritonmm.matmul(a, b)}, device, rounds, calls)
    return {"row": "Triton route, forced pointer kernel 16 x 64 x 64", "torch": "bare launch",
            "tritonmm": "tritonmm.matmul", "torch_us": us["bare launch"], "tritonmm_us": us["tritonmm.matmul"],
            "over_us": us["over"], "ratio": us["bare launch"] / (us["bare launch"] + us["over"])}
