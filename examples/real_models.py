"""Real models through tritonmm: transformers' Llama architecture and an MLP trained on scikit-learn's digits.

    python examples/real_models.py --device cuda --json real_models.json      # on a GPU
    TRITON_INTERPRET=1 python examples/real_models.py --device cpu --size tiny   # CPU smoke run

Part "matmul": every matmul of the model (nn.Linear, torch.matmul / @, mm, bmm) is routed to
``torch.ops.tritonmm.matmul`` by a TorchFunctionMode; a TorchDispatchMode counts the GEMM ops that
reach aten outside tritonmm (must be 0). Part "linear": nn.Linear patched (``tritonmm.patch_linear``)
and swapped (``tritonmm.swap_linear``), in a bf16 model and in an fp32 model under bf16 autocast.

Each tritonmm run (automatic dispatch, and dispatch forced to the Triton kernels) is compared with
the torch run in the same precision, and both with a float32 reference (TF32 off): the tritonmm
error must stay within twice torch's own bf16 error (+1e-3). Needs transformers and scikit-learn.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tritonmm

aten = torch.ops.aten
GEMM_ATEN = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
             aten.mv.default, aten.addmv.default, aten.dot.default, aten.vdot.default, aten.matmul.default,
             aten.linear.default, aten._scaled_mm.default, aten.einsum.default}


class RouteMatmuls(TorchFunctionMode):
    """Send every matmul-family call to torch.ops.tritonmm.matmul (F.linear as x @ W^T + b)."""

    MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
               torch.Tensor.bmm}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.MATMULS:
            return torch.ops.tritonmm.matmul(args[0], args[1])
        if func is torch.Tensor.__rmatmul__:
            return torch.ops.tritonmm.matmul(args[1], args[0])
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            y = torch.ops.tritonmm.matmul(x, w.t())
            return y if b is None else y + b
        return func(*args, **kwargs)


class CountOps(TorchDispatchMode):
    """Counts tritonmm ops and the GEMMs that reach aten without going through tritonmm."""

    def __init__(self):
        super().__init__()
        self.tritonmm = 0
        self.escaped: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("tritonmm."):
            self.tritonmm += 1
        elif func in GEMM_ATEN:
            self.escaped[name] = self.escaped.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_rel(g: dict, ref: dict) -> float:
    """Largest relative error over parameters (norm-wise per tensor)."""
    return max(rel(g[n], ref[n]) for n in ref)


# --------------------------------------------------------------------------- Llama


def make_llama(size: str, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = {"tiny": dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2),
            "small": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=8)}[size]
    cfg = LlamaConfig(**dims, max_position_embeddings=512, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).eval(), cfg


def llama_step(model, ids, ctx=contextlib.nullcontext(), autocast=False):
    model.zero_grad(set_to_none=True)
    with ctx, torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), out.loss.item(), grads_of(model)


def check(name: str, got: dict, torch_run: dict, ref: dict, report: dict) -> bool:
    """got/torch_run/ref: {"logits", "grads"}; pass if got's error vs ref <= 2x torch's + 1e-3."""
    entry = {}
    ok = True
    for key, fn in (("logits", rel), ("grads", grad_rel)):
        e_got, e_torch = fn(got[key], ref[key]), fn(torch_run[key], ref[key])
        entry[key] = {"err_vs_fp32": e_got, "torch_err_vs_fp32": e_torch, "vs_torch": fn(got[key], torch_run[key])}
        ok &= e_got <= 2 * e_torch + 1e-3
    entry["ok"] = bool(ok)
    report[name] = entry
    print(f"  {name:38} logits err {entry['logits']['err_vs_fp32']:.2e} (torch {entry['logits']['torch_err_vs_fp32']:.2e})"
          f"  grads err {entry['grads']['err_vs_fp32']:.2e} (torch {entry['grads']['torch_err_vs_fp32']:.2e})"
          f"  {'ok' if ok else 'FAIL'}")
    return ok


def run_llama(args, device, report) -> bool:
    print(f"Llama ({args.size}) forward + backward, bf16")
    model32, cfg = make_llama(args.size, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    seq = 128 if args.size == "small" else 8
    ids = torch.randint(0, cfg.vocab_size, (4, seq), generator=gen).to(device)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})  # same (bf16) weights
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        lg, _, gr = llama_step(model32, ids)
        ref = {"logits": lg, "grads": gr}
    finally:
        torch.set_float32_matmul_precision(prev)
    lg, _, gr = llama_step(model16, ids)
    torch_run = {"logits": lg, "grads": gr}
    ok = True
    sub = report.setdefault("llama", {"config": {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")},
        "tokens": list(ids.shape)})
    if "matmul" in args.parts:
        for mode in ("auto", "triton"):
            counter = CountOps()
            with tritonmm.force_backend(mode), RouteMatmuls(), counter:
                lg, _, gr = llama_step(model16, ids)
            ok &= check(f"matmul-route[{mode}]", {"logits": lg, "grads": gr}, torch_run, ref, sub)
            sub[f"matmul-route[{mode}]"].update(tritonmm_ops=counter.tritonmm, escaped_gemms=counter.escaped)
            print(f"    tritonmm ops: {counter.tritonmm}, GEMMs outside tritonmm: {counter.escaped or 0}")
            ok &= counter.tritonmm > 0 and not counter.escaped
    if "linear" in args.parts:
        for mode in ("auto", "triton"):
            with tritonmm.force_backend(mode), tritonmm.patch_linear():
                lg, _, gr = llama_step(model16, ids)
            ok &= check(f"patch_linear[{mode}] bf16", {"logits": lg, "grads": gr}, torch_run, ref, sub)
        # fp32 master weights under bf16 autocast: patched vs unpatched, both against the fp32 reference
        lg, _, gr = llama_step(model32, ids, autocast=True)
        torch_ac = {"logits": lg, "grads": gr}
        swapped = tritonmm.swap_linear(copy.deepcopy(model32))
        for mode in ("auto", "triton"):
            with tritonmm.force_backend(mode):
                lg, _, gr = llama_step(swapped, ids, autocast=True)
            ok &= check(f"swap_linear[{mode}] fp32+autocast", {"logits": lg, "grads": gr}, torch_ac, ref, sub)
    return ok


# --------------------------------------------------------------------------- MLP on digits


def digits(device):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    X, y = X[perm].to(device), y[perm].to(device)
    n_train = int(0.8 * len(X))
    return (X[:n_train], y[:n_train]), (X[n_train:], y[n_train:])


def make_mlp(device, dtype, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10)).to(device, dtype)


def batches(n, device, epoch_gen):
    perm = torch.randperm(n, generator=epoch_gen).to(device)
    return [perm[i:i + 64] for i in range(0, n, 64)]


def train_mlp(train, test, device, dtype, epochs, ctx_fn=contextlib.nullcontext, autocast=False):
    """Adam on the digits; returns per-epoch mean loss, test accuracy and the first step's gradients."""
    model = make_mlp(device, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    X, y = train
    gen = torch.Generator().manual_seed(0)
    losses, first_grads = [], None
    for _ in range(epochs):
        total = 0.0
        for idx in batches(len(X), device, gen):
            with ctx_fn(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(X[idx].to(dtype)).float(), y[idx])
            opt.zero_grad(set_to_none=True)
            with ctx_fn():
                loss.backward()
            if first_grads is None:
                first_grads = grads_of(model)
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(X))
    with torch.no_grad(), ctx_fn(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        acc = (model(test[0].to(dtype)).argmax(-1) == test[1]).float().mean().item()
    return {"losses": losses, "acc": acc, "grads": first_grads}


def mlp_reference_grads(train, device, dtype) -> dict:
    """First-step gradients in float32 (TF32 off) from the same initial weights (as rounded to dtype)."""
    model = make_mlp(device, dtype).float()
    X, y = train
    idx = batches(len(X), device, torch.Generator().manual_seed(0))[0]
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        F.cross_entropy(model(X[idx].to(dtype).float()), y[idx]).backward()
    finally:
        torch.set_float32_matmul_precision(prev)
    return grads_of(model)


def run_digits(args, device, report) -> bool:
    train, test = digits(device)
    epochs = args.epochs
    print(f"MLP 64-256-256-10 on sklearn digits ({len(train[0])} train / {len(test[0])} test), {epochs} epochs, Adam")
    variants = {}
    if "matmul" in args.parts:
        variants["torch bf16"] = dict(dtype=torch.bfloat16)
        for mode in ("auto", "triton"):
            variants[f"matmul-route[{mode}] bf16"] = dict(
                dtype=torch.bfloat16,
                ctx_fn=lambda m=mode: _stack(tritonmm.force_backend(m), RouteMatmuls()))
    if "linear" in args.parts:
        variants["torch fp32+autocast"] = dict(dtype=torch.float32, autocast=True)
        for mode in ("auto", "triton"):
            variants[f"patch_linear[{mode}] fp32+autocast"] = dict(
                dtype=torch.float32, autocast=True,
                ctx_fn=lambda m=mode: _stack(tritonmm.force_backend(m), tritonmm.patch_linear()))
    results = {name: train_mlp(train, test, device, epochs=epochs, **kw) for name, kw in variants.items()}
    refs = {dt: mlp_reference_grads(train, device, dt) for dt in {kw["dtype"] for kw in variants.values()}}
    sub = report.setdefault("digits", {})
    ok = True
    for name, res in results.items():
        base = "torch bf16" if name.endswith(" bf16") else "torch fp32+autocast"
        torch_res, ref = results[base], refs[variants[name]["dtype"]]
        dloss = max(abs(a - b) for a, b in zip(res["losses"], torch_res["losses"]))
        loss_tol = 0.02 + 0.05 * max(torch_res["losses"])
        grad_err, torch_grad_err = grad_rel(res["grads"], ref), grad_rel(torch_res["grads"], ref)
        good = dloss <= loss_tol and abs(res["acc"] - torch_res["acc"]) <= 0.02 and grad_err <= 2 * torch_grad_err + 1e-3
        ok &= good
        sub[name] = {"losses": res["losses"], "acc": res["acc"], "max_loss_diff_vs_torch": dloss,
                     "first_step_grad_err_vs_fp32": grad_err, "torch_grad_err_vs_fp32": torch_grad_err, "ok": good}
        print(f"  {name:36} acc {res['acc']:.4f}  loss {' '.join(f'{x:.3f}' for x in res['losses'])}"
              f"  |dloss| {dloss:.3f}  grad err {grad_err:.1e} (torch {torch_grad_err:.1e})  {'ok' if good else 'FAIL'}")
    return ok


@contextlib.contextmanager
def _stack(*cms):
    with contextlib.ExitStack() as stack:
        for cm in cms:
            stack.enter_context(cm)
        yield


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=["tiny", "small"], default=None)
    p.add_argument("--parts", nargs="+", choices=["matmul", "linear"], default=["matmul", "linear"])
    p.add_argument("--models", nargs="+", choices=["llama", "digits"], default=["llama", "digits"])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.size = args.size or ("small" if device.type == "cuda" else "tiny")
    args.epochs = args.epochs or (8 if device.type == "cuda" else 1)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__}
    ok = True
    if "llama" in args.models:
        ok &= run_llama(args, device, report)
    if "digits" in args.models:
        ok &= run_digits(args, device, report)
    report["ok"] = bool(ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
