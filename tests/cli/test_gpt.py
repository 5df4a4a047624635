"""The small causal transformer: its size checks, shapes, causality, tied head, init, and that
it learns."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distoptim.cli.gpt import GPT, GPTConfig, build_gpt

TINY = GPTConfig(vocab_size=11, layers=2, width=16, heads=4, context=12)


def test_default_size() -> None:
    cfg = GPTConfig(vocab_size=75)
    assert (cfg.layers, cfg.width, cfg.heads, cfg.context) == (2, 128, 4, 64)
    assert cfg.num_parameters() == sum(p.numel() for p in build_gpt(cfg, 0).parameters())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"width": 30, "heads": 4}, ValueError, "width must be a multiple of heads"),
        ({"layers": 0}, ValueError, "layers must be an int >= 1"),
        ({"context": True}, ValueError, "context must be an int"),
        ({"vocab_size": 1}, ValueError, "vocab_size must be an int >= 2"),
        ({"heads": 2.0}, ValueError, "heads must be an int"),
    ],
)
def test_size_is_checked(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GPTConfig(**{"vocab_size": 11, **kwargs})


def test_build_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="GPTConfig"):
        build_gpt({"vocab_size": 11}, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        build_gpt(TINY, -1)


def test_shapes_and_too_long_inputs() -> None:
    model = build_gpt(TINY, 0)
    idx = torch.randint(TINY.vocab_size, (3, 7))
    assert model(idx).shape == (3, 7, TINY.vocab_size)
    assert model(idx.to(torch.uint8)).shape == (3, 7, TINY.vocab_size)
    full = torch.randint(TINY.vocab_size, (2, TINY.context))
    assert model(full).shape == (2, TINY.context, TINY.vocab_size)
    with pytest.raises(ValueError, match="T <= context 12"):
        model(torch.zeros(1, TINY.context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(TINY.context, dtype=torch.long))


@pytest.mark.parametrize("changed", [0, 5, 11])
def test_a_later_token_never_changes_an_earlier_logit(changed: int) -> None:
    model = build_gpt(TINY, 1)
    idx = torch.randint(
        TINY.vocab_size, (2, TINY.context), generator=torch.Generator().manual_seed(0)
    )
    other = idx.clone()
    other[:, changed] = (other[:, changed] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(other)
    torch.testing.assert_close(a[:, :changed], b[:, :changed], rtol=0, atol=1e-6)
    assert (a[:, changed:] - b[:, changed:]).abs().amax(dim=-1).min() > 1e-4  # it does see it


def test_the_output_head_is_the_token_embedding() -> None:
    model = build_gpt(TINY, 0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes.count((TINY.vocab_size, TINY.width)) == 1  # no separate head matrix
    seen = {}
    model.ln_out.register_forward_hook(lambda _m, _i, out: seen.setdefault("h", out))
    idx = torch.randint(TINY.vocab_size, (2, 5))
    logits = model(idx)
    torch.testing.assert_close(logits, seen["h"] @ model.tok.weight.T)
    logits.sum().backward()  # the head's gradient reaches the embedding too: every row
    assert bool((model.tok.weight.grad.abs().sum(dim=1) > 0).all())


def test_seeded_gpt2_init() -> None:
    gen_state = torch.random.get_rng_state()
    cfg = GPTConfig(vocab_size=64, layers=4, width=64, heads=4, context=32)
    a, b, c = build_gpt(cfg, 3), build_gpt(cfg, 3), build_gpt(cfg, 4)
    assert torch.equal(torch.random.get_rng_state(), gen_state)  # the global RNG is untouched
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.tok.weight, c.tok.weight)
    assert isinstance(a, GPT)
    residual = 0.02 / math.sqrt(2 * cfg.layers)
    for block in a.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.proj.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert not block.fc.bias.any()
        assert torch.equal(block.ln_attn.weight, torch.ones(cfg.width))
    assert a.tok.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_loss_decreases_in_a_few_steps() -> None:
    torch.manual_seed(0)
    model = build_gpt(TINY, 0)
    text = torch.tensor([i % 7 for i in range(200)])  # a period-7 sequence
    starts = torch.arange(0, 200 - TINY.context - 1, 5)
    idx = starts.unsqueeze(1) + torch.arange(TINY.context + 1)
    x, y = text[idx[:, :-1]], text[idx[:, 1:]]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x).reshape(-1, TINY.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(TINY.vocab_size), rel=0.1)  # near uniform
    assert losses[-1] < 0.3 * losses[0]
