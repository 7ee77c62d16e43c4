"""GPT model: shapes, causality, weight tying, sampling, config validation."""

import pytest
import torch
from ddplab.model import GPT, GPTConfig


def make(**kw) -> GPT:
    cfg = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def test_forward_shapes_and_loss():
    model = make()
    idx = torch.randint(0, 65, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 65)
    assert loss.shape == ()
    # untrained model with small init: loss close to ln(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.5
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, 65) and loss is None


def test_sequence_longer_than_block_is_rejected():
    model = make()
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_head_is_tied_to_token_embedding():
    model = make()
    assert model.head.weight is model.tok_emb.weight
    distinct = {id(p) for p in model.parameters()}
    assert len(distinct) == len(list(model.parameters()))
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    # 65*32 tok + 16*32 pos + 2 blocks + final LN; the head adds nothing
    per_block = 2 * 32 * 2 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    assert model.num_params() == 65 * 32 + 16 * 32 + 2 * per_block + 2 * 32


def test_attention_is_causal():
    model = make().eval()
    idx = torch.randint(0, 65, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 65
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_default_cpu_config_size():
    model = make(block_size=64, n_layer=4, n_head=4, n_embd=128)
    assert 800_000 < model.num_params() < 820_000


def test_param_groups_split_decay():
    model = make()
    groups = model.param_groups(0.1)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in groups[0]["params"])
    assert all(p.dim() == 1 for p in groups[1]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))


def test_generate_is_seeded_and_keeps_training_mode():
    model = make().train()
    start = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(start, 40, generator=torch.Generator().manual_seed(7))
    b = model.generate(start, 40, generator=torch.Generator().manual_seed(7))
    assert a.shape == (1, 41)
    assert torch.equal(a, b)
    assert model.training
    top1 = model.generate(start, 5, top_k=1)
    assert top1.shape == (1, 6)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(start, 1, temperature=0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_embd": 30, "n_head": 4}, "divisible by n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"block_size": -1}, "block_size"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_gpt_config_rejects_bad_shapes(kw, match):
    cfg = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    with pytest.raises(ValueError, match=match):
        GPTConfig(**cfg)
