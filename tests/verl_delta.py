"""How dense verl's sparse delta sync gets under each export mode: ``python -m tests.verl_delta``.

verl's ``delta_sharded`` checkpoint engine sends only the bf16 elements whose bits changed since the last sync
(``checkpoint_engine/changed_ratio``). This trains the shipped tiny-qwen3 (fp32 master, AdamW, next-token loss on a
fixed random batch) and prints that ratio per step for RNE (verl's cast), stochastic rounding and error feedback, as
``ShardExporter`` serves them (per-shard exports equal full-tensor ones, so one process gives the same counts as any
FSDP layout; tests/test_integration_verl.py checks the counts against verl's own delta export on 2 ranks).

Two starts: the checkpoint as shipped (bf16 weights upcast, so every master sits on the bf16 grid, like any RL run
from an HF bf16 checkpoint), and "off-grid", the same weights plus uniform noise below half a bf16 ulp (masters that
have trained in fp32 for a while).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from roundalign.integrations.verl import ShardExporter
from tests.verl_cpu import MODEL


def densities(lr: float, steps: int, off_grid: bool) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    if off_grid:
        with torch.no_grad():
            for p in model.parameters():
                ulp = torch.ldexp(torch.ones_like(p), torch.frexp(p)[1] - 8)  # bf16 spacing at |p|
                p.add_((torch.rand_like(p) - 0.5) * ulp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.randint(1, 264, (4, 32), generator=torch.Generator().manual_seed(1))
    exporters = {mode: ShardExporter(mode, seed=0) for mode in ("rne", "stochastic", "error-feedback")}

    def export(ex):
        return {n: ex.export(n, p.detach(), 0) for n, p in model.named_parameters()}

    served = {mode: export(ex) for mode, ex in exporters.items()}
    total = sum(p.numel() for p in model.parameters())
    out = {mode: [] for mode in exporters}
    for _ in range(steps):
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for mode, ex in exporters.items():
            ex.next_version()
            new = export(ex)
            changed = sum(int((new[n].view(torch.int16) != served[mode][n].view(torch.int16)).sum()) for n in new)
            out[mode].append(changed / total)
            served[mode] = new
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    args = parser.parse_args()
    for off_grid in (False, True):
        for lr in args.lr:
            for mode, values in densities(lr, args.steps, off_grid).items():
                start = "off-grid" if off_grid else "bf16 ckpt"
                print(f"{start:9s} lr={lr:g} {mode:14s} " + " ".join(f"{100 * v:5.1f}" for v in values))


if __name__ == "__main__":
    main()
