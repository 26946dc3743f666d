"""Packed preference rows (`data.packing: true`): a micro-batch's sequences end to end in one row, each attending
only to itself, give the padded layout's completion log-probs, losses and metrics."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.configs import KTO_RECORDS, PAIRS, preference_config
from tests.runtime.worker_groups import logged_steps
from tigon.runtime.attention import transformers_name
from tigon.runtime.batches import collate
from tigon.runtime.config import parse_config
from tigon.runtime.objectives import final_hidden, sequence_reference_logps
from tigon.runtime.preference_batch import preference_rows
from tigon.runtime.preference_data import build_preference_datasets
from tigon.runtime.tokenizer import load_tokenizer
from tigon.runtime.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def micro_batch(config, size: int = 3) -> dict[str, torch.Tensor]:
    train_set, _, _ = build_preference_datasets(config, load_tokenizer(config.model))
    return collate([train_set[i] for i in range(size)])


def with_packing(config, packing: bool, attention: str = "auto"):
    raw = config.model_dump(mode="json")
    raw["data"]["packing"] = packing
    raw["model"]["attn_implementation"] = attention
    return parse_config(raw)


def test_preference_data_is_padded_unless_packing_is_set(tmp_path):
    """The config default packs SFT documents; preference pairs stay padded rows until `data.packing: true`."""
    assert preference_config(tmp_path, "dpo").data.packing is False
    assert preference_config(tmp_path, "dpo", data={"packing": True}).data.packing is True


@pytest.mark.parametrize("attention", ["sdpa", "varlen", "eager"])
def test_a_packed_row_holds_each_sequence_once_with_its_own_positions(tmp_path, attention):
    """3 pairs -> one row of their 6 sequences' tokens (chosen rows, then rejected), no padding, position ids
    restarting at 0 per sequence; gathered back, each token lands where the padded layout has it, padding zeroed;
    the targets are the padded layout's. sdpa and eager get the block-diagonal mask, varlen the boundaries."""
    config = preference_config(tmp_path, "dpo")
    batch = micro_batch(config)
    padded = preference_rows(batch, False, attention, torch.device("cpu"))
    packed = preference_rows(batch, True, attention, torch.device("cpu"))
    mask = padded.inputs["attention_mask"].bool()
    lengths = mask.sum(-1)
    assert padded.target.shape == (6, int(lengths.max()))
    assert torch.equal(packed.target, padded.target)
    assert torch.equal(packed.inputs["input_ids"], padded.inputs["input_ids"][mask][None])
    expected_positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    assert torch.equal(packed.inputs["position_ids"], expected_positions)
    ids = packed.inputs["input_ids"]
    gathered = packed.op_layout(ids[..., None].double())[..., 0]
    assert torch.equal(gathered, torch.where(mask, padded.inputs["input_ids"], 0).double())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    if attention == "varlen":
        assert packed.inputs["cu_seq_lens_q"].tolist() == offsets.tolist()
        assert packed.inputs["max_length_q"] == int(lengths.max())
        assert "attention_mask" not in packed.inputs
    else:
        allowed = packed.inputs["attention_mask"][0, 0]
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0
        document = torch.repeat_interleave(torch.arange(6), lengths)
        causal = torch.ones(len(document), len(document), dtype=torch.bool).tril()
        assert torch.equal(allowed, causal & (document[:, None] == document[None, :]))


@pytest.mark.parametrize("packing", [False, True])
def test_fp8_rows_hold_a_multiple_of_16_tokens_and_the_same_sequences(tmp_path, packing):
    """Under fp8 (`token_multiple` 16) padded rows are cut at the next multiple of 16 columns and a packed row
    ends in a padding sequence of its own; the fused op still reads each sequence's tokens where they were, and
    the padding as zeros."""
    config = preference_config(tmp_path, "dpo", data={"max_seq_len": 48})
    batch = micro_batch(config)
    cpu = torch.device("cpu")
    plain = preference_rows(batch, packing, "varlen", cpu)
    fp8 = preference_rows(batch, packing, "varlen", cpu, token_multiple=16)
    assert fp8.inputs["input_ids"].numel() % 16 == 0
    assert plain.inputs["input_ids"].numel() % 16 != 0
    length = plain.target.shape[1]
    assert torch.equal(fp8.target[:, :length], plain.target)
    assert bool((fp8.target[:, length:] == -100).all())
    ids = (plain if not packing else fp8).inputs["input_ids"]
    if packing:
        assert fp8.inputs["cu_seq_lens_q"].tolist()[:-1] == plain.inputs["cu_seq_lens_q"].tolist()
        assert torch.equal(fp8.inputs["input_ids"][:, : plain.inputs["input_ids"].shape[1]], plain.inputs["input_ids"])
        gathered = fp8.op_layout(ids[..., None].double())[..., 0]
        assert torch.equal(gathered[:, :length], plain.op_layout(plain.inputs["input_ids"][..., None].double())[..., 0])
        assert bool((gathered[:, length:] == 0).all())
    else:
        assert torch.equal(fp8.inputs["input_ids"][:, :length], ids)


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_rows_give_the_padded_hidden_states_and_reference_logps(tmp_path, attention):
    """The tiny Llama's final hidden states on every real token, and the reference pass's summed completion
    log-probs per sequence, agree between the layouts within float32 rounding."""
    from transformers import AutoModelForCausalLM

    config = preference_config(tmp_path, {"type": "dpo", "reference": "precomputed"})
    batch = micro_batch(config)
    implementation = transformers_name(attention)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, attn_implementation=implementation).eval()
    cpu = torch.device("cpu")
    padded, packed = (preference_rows(batch, packing, attention, cpu) for packing in (False, True))
    with torch.no_grad():
        expected = final_hidden(model, padded.inputs)[padded.inputs["attention_mask"].bool()]
        got = packed.op_layout(final_hidden(model, packed.inputs))[padded.inputs["attention_mask"].bool()]
    assert (got - expected).norm() <= 1e-5 * expected.norm()
    layouts = [with_packing(config, packing, attention) for packing in (False, True)]
    reference, logps = (sequence_reference_logps(model, batch, layout, cpu) for layout in layouts)
    assert reference.shape == (3, 2) and bool((reference < 0).all())
    torch.testing.assert_close(logps, reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("objective", "records", "attention"),
    [
        ({"type": "dpo", "reference": "model"}, PAIRS, "sdpa"),
        ({"type": "dpo", "reference": "precomputed"}, PAIRS, "varlen"),
        ({"type": "kto", "reference": "model"}, KTO_RECORDS, "varlen"),
        ({"type": "kto", "reference": "precomputed"}, KTO_RECORDS, "sdpa"),
    ],
    ids=["dpo-model-sdpa", "dpo-precomputed-varlen", "kto-model-varlen", "kto-precomputed-sdpa"],
)
def test_packed_training_gives_the_padded_losses_and_metrics(tmp_path, objective, records, attention):
    """2 steps of 4 pairs (KTO: completions) x 2 micro-batches, padded and packed: every step's loss and TRL metrics
    agree within float32 rounding, under the dense block-diagonal mask (sdpa) and per-document attention (varlen)."""
    runs = []
    for packing in (False, True):
        config = preference_config(
            tmp_path,
            objective,
            records,
            data={"packing": packing},
            model={"attn_implementation": attention},
            training={"max_steps": 2},
            logging={"run_dir": str(tmp_path / f"run-{packing}")},
        )
        runs.append(logged_steps(train(config).run_dir))
    padded, packed = runs
    assert len(padded) == len(packed) == 2
    names = METRICS + (("kl",) if objective["type"] == "kto" else ("rewards/accuracies",))
    for a, b in zip(padded, packed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (padded, packed)
        for name in names:
            assert abs(a[name] - b[name]) <= 1e-5 * max(1.0, abs(a[name])), (name, padded, packed)
    assert padded[1]["loss"] != padded[0]["loss"]  # the step trained: the comparison covers an update


def test_op_rows_without_prompts_hold_each_completion_and_train_the_same(tmp_path):
    """kernels.skip_unlabelled: the op's rows keep only each sequence's positions with a target, in order (the
    prompts' positions, most of these pairs', are left out); gathered, each is the token the full layout has there,
    padded and packed. 2 DPO steps give the same losses and TRL metrics with it (padded) as without it (packed; the
    two layouts agree without it, test_packed_training_gives_the_padded_losses_and_metrics)."""
    records = [{**pair, "prompt": "Add the numbers: " * (1 + i % 3) + pair["prompt"]} for i, pair in enumerate(PAIRS)]
    settings = {"records": records, "data": {"packing": True, "max_seq_len": 64}}
    batch = micro_batch(preference_config(tmp_path, {"type": "dpo", "reference": "model"}, **settings))
    cpu = torch.device("cpu")
    for packing in (False, True):
        full = preference_rows(batch, packing, "varlen", cpu)
        short = preference_rows(batch, packing, "varlen", cpu, skip_prompts=True)
        assert short.target.shape[1] == 16 and full.target.shape[1] > 40  # completions of 2-4 tokens, aligned to 16
        ids = full.inputs["input_ids"][..., None].double()
        full_ids, short_ids = full.op_layout(ids)[..., 0], short.op_layout(ids)[..., 0]
        for row in range(full.target.shape[0]):
            with_target = full.target[row] != -100
            count = int(with_target.sum())
            assert torch.equal(short.target[row, :count], full.target[row, with_target])
            assert torch.equal(short_ids[row, :count], full_ids[row, with_target])
            assert bool((short.target[row, count:] == -100).all()) and bool((short_ids[row, count:] == 0).all())
    runs = []
    for packing, skip in ((True, False), (False, True)):
        config = preference_config(
            tmp_path,
            {"type": "dpo", "reference": "model"},
            records=records,
            data={"packing": packing, "max_seq_len": 64},
            model={"attn_implementation": "varlen"},
            kernels={"enabled": False, "skip_unlabelled": skip},
            training={"max_steps": 2},
            logging={"run_dir": str(tmp_path / f"run-{packing}-{skip}")},
        )
        runs.append(logged_steps(train(config).run_dir))
    for a, b in zip(*runs, strict=True):
        for name in ("loss", *METRICS, "rewards/accuracies"):
            assert abs(a[name] - b[name]) <= 1e-5 * max(1.0, abs(a[name])), (name, runs)


def test_packed_pairs_under_fsdp2_give_the_padded_ddp_run(tmp_path):
    """torchrun, 2 ranks x micro-batch 2 x accumulation 2, 2 steps with a held-out evaluation: packed DPO rows
    (varlen boundaries) under FSDP2, the policy and its frozen reference copy sharded and the fused op run inside the
    root's forward, give the padded DDP run's per-step losses, last-step metrics and evaluation within 1e-5."""
    from tests.runtime.worker_groups import launch

    runs = {}
    for name, packing, strategy in [("padded-ddp", False, "ddp"), ("packed-fsdp", True, "fsdp")]:
        runs[name] = preference_config(
            tmp_path,
            {"type": "dpo", "reference": "model"},
            training={"micro_batch_size": 2, "max_steps": 2},
            data={"packing": packing, "eval": str(tmp_path / "train.jsonl")},
            model={"attn_implementation": "varlen"},
            parallelism={"strategy": strategy},
            logging={"run_dir": str(tmp_path / name)},
        )
    records = launch(tmp_path, runs, timeout=600)
    padded, packed = records["padded-ddp"], records["packed-fsdp"]
    last_padded, last_packed = (logged_steps(tmp_path / name)[-1] for name in runs)
    pairs = [*zip(packed["losses"], padded["losses"], strict=True)]
    pairs += [(last_packed[key], last_padded[key]) for key in last_padded if "/" in key]
    pairs += [(packed["eval"][key], padded["eval"][key]) for key in padded["eval"]]
    assert len(pairs) > 8 and len(padded["losses"]) == 2
    for got, want in pairs:
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-7, (padded, packed)


@pytest.mark.parametrize("packing", [False, True])
def test_the_last_layer_computes_only_the_positions_the_op_reads(tmp_path, packing):
    """With the prompts skipped, the model's last layer runs its MLP on only the positions the op's rows read, and
    the op's hidden states and their gradients are those of the whole layer's output gathered the same way."""
    from tigon.kernels.patching import apply
    from tigon.kernels.patching.causal_lm import decoder_of
    from tigon.runtime.model import build_model

    records = [{**pair, "prompt": "Add the numbers: " * (1 + i % 3) + pair["prompt"]} for i, pair in enumerate(PAIRS)]
    config = preference_config(tmp_path, "dpo", records=records, data={"packing": packing, "max_seq_len": 64})
    model = build_model(config, len(load_tokenizer(config.model))).train()
    apply(model, rms_norm=False, rope=False, swiglu=False)  # the last-layer swap, without the interpreted kernels
    layout = preference_rows(micro_batch(config, 4), packing, "varlen", torch.device("cpu"), skip_prompts=True)
    positions = layout.inputs["input_ids"].numel()
    assert layout.read is not None and len(layout.read) % 16 == 0 and len(layout.read) < positions / 2
    rows_seen = []
    decoder_of(model).layers[-1].mlp.register_forward_pre_hook(lambda _, args: rows_seen.append(args[0].shape[:-1]))
    weights = torch.randn(layout.target.shape + (model.config.hidden_size,), generator=torch.Generator().manual_seed(0))
    outputs, gradients = [], []
    for read in (None, layout.read):
        model.zero_grad()
        hidden = layout.op_layout(final_hidden(model, layout.inputs, rows=read))
        (hidden * weights).sum().backward()
        outputs.append(hidden.detach())
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert [tuple(shape) for shape in rows_seen] == [tuple(layout.inputs["input_ids"].shape), (1, len(layout.read))]
    assert torch.allclose(outputs[1], outputs[0], atol=1e-6, rtol=1e-5)
    assert float((gradients[1] - gradients[0]).norm() / gradients[0].norm()) < 1e-5
