"""Did the engine serve exactly what the trainer exported? Digests of both sides of every weight sync, compared.

With ``ROUNDALIGN_VERL_AUDIT=DIR`` in the environment of verl's workers (the launcher's ``--audit``):

- each FSDP rank writes ``DIR/trainer-<rank>-<sync>.json``: per weight, the digest of the bf16 tensor the rollout
  is to serve. verl's own export hands the rollout the fp32 master and vLLM's loader casts it
  (``param.data.copy_``: round to nearest even), so under ``ROUNDALIGN_SYNC`` unset or ``rne`` the digest is of that
  cast; under ``stochastic`` or ``error-feedback`` it is of the bf16 tensor roundalign's exporter sent;
- each vLLM engine process writes ``DIR/engine-<replica>-<sync>.json`` after the sync: the digest of every weight it
  serves, read back through its own kernels (``rollout.py``), and its thread count and attention KV-split setting.

``check(DIR)`` compares sync by sync: every weight of every engine replica equal to the trainer's export of the same
sync, no weight missing on either side. A digest is the sha256 of the tensor's shape and bf16 bits, with -0 read as
+0 (the read-back through a GEMM cannot carry a zero's sign).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from pathlib import Path

import torch

from roundalign import durable

ENV = "ROUNDALIGN_VERL_AUDIT"
_exports = {"count": 0}


def digest(tensor: torch.Tensor) -> str:
    """sha256 of ``tensor``'s shape and bits as bf16, -0 as +0 (floating tensors; others as they are)."""
    t = tensor.detach().cpu()
    if t.is_floating_point():
        t = t.to(torch.bfloat16)
        t = torch.where(t == 0, torch.zeros_like(t), t)
        data = t.contiguous().view(torch.int16)
    else:
        data = t.contiguous()
    h = hashlib.sha256(repr(tuple(t.shape)).encode())
    h.update(data.numpy().tobytes())
    return h.hexdigest()


def hook(ti) -> list:
    """Tee ``FSDPEngine.get_per_tensor_param`` (``ti``: verl's ``transformer_impl``) into ``trainer-*.json``."""
    original = ti.FSDPEngine.get_per_tensor_param

    def get_per_tensor_param(self, *args, **kwargs):
        per_tensor, extra = original(self, *args, **kwargs)
        return _teed(per_tensor), extra

    get_per_tensor_param.__doc__ = original.__doc__
    ti.FSDPEngine.get_per_tensor_param = get_per_tensor_param
    return [(ti.FSDPEngine, "get_per_tensor_param", original)]


def _teed(per_tensor):
    directory = Path(os.environ[ENV])
    _exports["count"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    digests = {}
    for name, tensor in per_tensor:
        digests[name] = digest(tensor)
        yield name, tensor
    write(directory / f"trainer-{rank}-{_exports['count']}.json", digests)


def write(path: Path, record: dict) -> None:
    """One side's digests of one sync, written whole (``check`` reads only finished files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_text(path, json.dumps(record, sort_keys=True))


_NAME = re.compile(r"^(trainer|engine)-(\d+)-(\d+)\.json$")


def check(directory: str | Path) -> dict:
    """``{"syncs", "replicas", "weights", "changed", "engine", "problems"}``: every engine replica's served weights
    against the trainer's export, sync by sync (``problems`` empty when every weight of every sync matched);
    ``changed``: how many weights the trainer's export changed from one sync to the next; ``engine``: the engines'
    thread counts and KV-split settings seen."""
    files: dict[tuple[str, int], dict[int, dict]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        m = _NAME.match(path.name)
        if m:
            files.setdefault((m[1], int(m[2])), {})[int(m[3])] = json.loads(path.read_text())
    trainers = {k[1]: v for k, v in files.items() if k[0] == "trainer"}
    records = {k[1]: v for k, v in files.items() if k[0] == "engine"}
    engines = {r: {n: rec["weights"] for n, rec in syncs.items()} for r, syncs in records.items()}
    settings = sorted({(rec["threads"], rec["attn_split_kv"]) for syncs in records.values() for rec in syncs.values()})
    problems = []
    if not trainers or not engines:
        problems.append(f"{directory}: no {'trainer' if not trainers else 'engine'} digests (was {ENV} set?)")
        return {"syncs": 0, "replicas": len(engines), "weights": 0, "changed": [], "engine": [], "problems": problems}
    reference = trainers[min(trainers)]
    for rank, syncs in trainers.items():
        if syncs != reference:
            problems.append(f"trainer rank {rank} exported other weights than rank {min(trainers)}")
    weights = 0
    for replica, syncs in sorted(engines.items()):
        if sorted(syncs) != sorted(reference):
            problems.append(f"engine replica {replica} saw syncs {sorted(syncs)}, the trainer sent {sorted(reference)}")
        for sync in sorted(set(syncs) & set(reference)):
            sent, served = reference[sync], syncs[sync]
            missing = sorted(set(sent) - set(served))
            extra = sorted(set(served) - set(sent))
            differ = sorted(n for n in set(sent) & set(served) if sent[n] != served[n])
            weights += len(set(sent) & set(served))
            for what, names in (("not served", missing), ("served but not sent", extra), ("differ", differ)):
                if names:
                    problems.append(f"sync {sync}, replica {replica}: {len(names)} weights {what} ({names[0]}, ...)")
    order = sorted(reference)
    changed = [sum(reference[b].get(n) != d for n, d in reference[a].items()) for a, b in itertools.pairwise(order)]
    engine = [{"threads": t, "attn_split_kv": split} for t, split in settings]
    return {"syncs": len(reference), "replicas": len(engines), "weights": weights, "changed": changed,
            "engine": engine, "problems": problems}  # fmt: skip


__all__ = ["ENV", "check", "digest", "hook", "write"]
