"""Packed documents through "varlen" attention: boundaries from position ids, no dense mask, exact results.

On the CPU the boundaries drive per-document SDPA (the CUDA kernel's end-to-end test is test_attention_gpu.py);
everything around the kernel (the boundaries, their way through the model and its checkpointing, grouped-query
heads, sliding windows, the trainer) runs here.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tests.runtime.documents import packed_batch
from tigon.runtime.attention import VARLEN, document_boundaries, resolve, transformers_name
from tigon.runtime.data import model_inputs, token_multiple
from tigon.runtime.model import enable_activation_checkpointing


def test_document_boundaries_are_the_documents_offsets():
    bounds = document_boundaries(packed_batch()["position_ids"])
    assert bounds["cu_seq_lens_q"].tolist() == [0, 1, 8, 23, 26, 37, 42, 46, 69]
    assert bounds["cu_seq_lens_q"].dtype == torch.int32 and bounds["cu_seq_lens_k"] is bounds["cu_seq_lens_q"]
    assert bounds["max_length_q"] == bounds["max_length_k"] == 23
    # a row that starts inside a document (position ids not at 0) still starts a document of its own
    assert document_boundaries(torch.tensor([[4, 5, 0, 1], [2, 3, 4, 5]]))["cu_seq_lens_q"].tolist() == [0, 2, 4, 8]


def test_document_boundaries_reject_bad_input():
    with pytest.raises(ValueError, match=r"\(batch, length\) tensor, got \(4,\)"):
        document_boundaries(torch.arange(4))
    with pytest.raises(ValueError, match="integer tensor"):
        document_boundaries(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="non-empty"):
        document_boundaries(torch.zeros(1, 0, dtype=torch.long))


def test_auto_is_varlen_only_where_cuda_is():
    assert resolve("auto") == ("varlen" if torch.cuda.is_available() else "sdpa")
    assert resolve("sdpa") == "sdpa" and resolve("varlen") == "varlen"
    assert transformers_name("varlen") == VARLEN and transformers_name("eager") == "eager"


def test_model_inputs_per_attention_implementation():
    batch = packed_batch()
    varlen = model_inputs(batch, "varlen")
    assert "attention_mask" not in varlen and varlen["max_length_q"] == 23
    assert varlen["cu_seq_lens_q"].tolist() == [0, 1, 8, 21, 24, 35, 40, 44, 67]  # the first row's padding dropped
    real = torch.ones_like(batch["labels"], dtype=torch.bool)
    real[0, 21:] = False  # the first row's padding goes
    assert torch.equal(varlen["input_ids"], batch["input_ids"][real][None])
    assert torch.equal(varlen["position_ids"], batch["position_ids"][real][None])
    expected = batch["labels"].clone()
    expected[:, 0] = -100  # a row's first label follows the previous row now; the shift never predicted it
    assert torch.equal(varlen["labels"], expected[real][None])
    assert set(model_inputs(batch, "flex_attention")) == {"input_ids", "labels", "position_ids"}
    assert model_inputs(batch, "auto").keys() == model_inputs(batch, resolve("auto")).keys()
    whole = packed_batch([[21], [21]])  # one document a row, labelled to the end: the rows as they are
    assert {key: value.shape for key, value in model_inputs(whole, "varlen").items()} == {
        key: (2, 21) for key in ("input_ids", "labels", "position_ids")
    }
    assert model_inputs(packed_batch([[21], [19]]), "varlen")["input_ids"].shape == (1, 40)  # padding dropped
    unlabelled = packed_batch()
    unlabelled["labels"][:] = -100  # no loss anywhere: one token keeps the forward defined
    assert model_inputs(unlabelled, "varlen")["cu_seq_lens_q"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="unknown attn_implementation 'flex'; use auto, varlen"):
        model_inputs(batch, "flex")


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_loss_positions_skip_prompts_with_the_same_loss_and_gradients(attention):
    """With `loss_positions` the fused loss's head projects only the positions whose next token has a label: the
    positions are those, and the loss and every gradient are the ones without."""
    from tigon.kernels.patching import apply

    batch = packed_batch()
    batch["labels"][0, 1:8] = batch["labels"][1, 3:12] = -100  # prompts: tokens without a loss
    inputs = model_inputs(batch, attention, loss_positions=True)
    labels = inputs["labels"]
    expected = [
        i
        for i in range(labels.numel())
        if i % labels.shape[1] < labels.shape[1] - 1 and labels.flatten()[i + 1] != -100
    ]
    positions = inputs["loss_positions"].tolist()
    assert set(expected) < set(positions) and len(positions) == 48  # 45 with a label, 3 without: a multiple of 16
    assert positions == sorted(positions)
    model = tiny()[1 if attention == "varlen" else 0]
    models = model, copy.deepcopy(model)
    for model in models:
        apply(model, rms_norm=False, rope=False, swiglu=False)
    losses = [
        model(**model_inputs(batch, attention, loss_positions=flag), use_cache=False, num_items_in_batch=1).loss
        for model, flag in zip(models, (True, False), strict=True)
    ]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-6 * losses[1].item()
    assert relative(gradients(models[0]), gradients(models[1])) < 1e-6
    whole = packed_batch([[21], [21]])  # every position but the rows' last predicts a label: nothing to skip
    assert "loss_positions" not in model_inputs(whole, attention, loss_positions=True)
    few = packed_batch([[64], [64]])
    few["labels"][0, 1:14] = -100  # 113 of 128 positions with a label, 128 aligned to 16: nothing left to skip
    assert "loss_positions" not in model_inputs(few, attention, loss_positions=True)
    few["labels"][0, 14] = -100  # 112: a sixteenth skipped
    assert len(model_inputs(few, attention, loss_positions=True)["loss_positions"]) == 112


def tiny(model_class=LlamaForCausalLM, config_class=LlamaConfig, **overrides):
    """(sdpa model, varlen model) with the same random weights: grouped-query heads, fp32."""
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    config = config_class(**shape, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    dense = model_class._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    varlen = model_class._from_config(copy.deepcopy(config), attn_implementation=transformers_name("varlen"))
    varlen.load_state_dict(dense.state_dict())
    assert (dense.config._attn_implementation, varlen.config._attn_implementation) == ("sdpa", VARLEN)
    return dense, varlen


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_documents_train_as_if_alone(checkpointing):
    """Logits of each document in a packed row equal its logits alone; the loss and every gradient equal the
    dense-mask path's (documents of 1 to 23 tokens, grouped-query heads, with and without checkpointing)."""
    dense, varlen = tiny()
    if checkpointing:
        for model in (dense, varlen):
            enable_activation_checkpointing(model)
    batch = packed_batch()
    dense_out = dense(**model_inputs(batch, "sdpa"), use_cache=False)
    varlen_out = varlen(**model_inputs(batch, "varlen"), use_cache=False)
    dense_out.loss.backward()
    varlen_out.loss.backward()
    inputs = model_inputs(batch, "varlen")
    real = varlen_out.logits[0]  # the rows' tokens without the first row's 2 padding tokens, one after another
    assert real.shape[0] == 67
    assert relative(real[:21], dense_out.logits[0, :21]) < 1e-6
    assert relative(real[21:], dense_out.logits[1:].flatten(0, 1)) < 1e-6
    assert abs(varlen_out.loss.item() - dense_out.loss.item()) < 1e-6 * dense_out.loss.item()
    assert relative(gradients(varlen), gradients(dense)) < 1e-5
    bounds = inputs["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):  # documents of 1 to 23 tokens
            alone = dense(input_ids=inputs["input_ids"][:, start:end]).logits[0]
            assert relative(real[start:end], alone) < 1e-6


def assert_same_loss_and_gradients(model, expected: dict, got: dict) -> None:
    """The model's loss and every gradient on the inputs `got` are those on `expected`."""
    losses, grads = [], []
    for inputs in (expected, got):
        model.zero_grad()
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(gradients(model))
    assert abs(losses[1] - losses[0]) <= 1e-6 * losses[0]
    assert relative(grads[1], grads[0]) < 1e-6


def test_fp8_batches_keep_padding_up_to_a_multiple_of_16():
    """FP8 matmuls contract the weight gradient over the tokens, which the GPU's kernel takes only in multiples of
    16: `token_multiple` keeps the first padding tokens after the rows' last labels (93 real tokens -> 96), and the
    loss and every gradient stay the padding-free batch's."""
    _, model = tiny()
    batch = packed_batch(rows=[[1, 7, 13], [3, 11, 5, 4], [23], [9, 17]])
    plain, fp8 = model_inputs(batch, "varlen"), model_inputs(batch, "varlen", token_multiple=token_multiple("fp8"))
    assert plain["input_ids"].shape[1] == 93 and fp8["input_ids"].shape[1] == 96
    assert fp8["cu_seq_lens_q"].tolist()[-1] == 96
    assert_same_loss_and_gradients(model, plain, fp8)
    assert token_multiple("bf16") == 1
    full = packed_batch(rows=[[3, 4], [7]])  # 7 tokens in rows of 7: no padding to keep
    with pytest.raises(ValueError, match="make data.max_seq_len a multiple of 16"):
        model_inputs(full, "varlen", token_multiple=16)


def test_whole_rows_feed_one_token_count_with_the_same_loss_and_gradients():
    """`whole_rows` (training.static_shapes): every row whole, padding and all, so micro-batches of as many rows have
    the same token count; no labelled token sees the padding, so the loss, every gradient and the head's positions
    are the padding-free batch's."""
    _, model = tiny()
    batch = packed_batch(rows=[[1, 7, 13], [3, 11, 5, 4], [9, 17]])  # rows of 26: 5, 3 and 0 padding tokens
    plain, whole = model_inputs(batch, "varlen"), model_inputs(batch, "varlen", whole_rows=True)
    assert plain["input_ids"].shape == (1, 70) and whole["input_ids"].shape == (1, 78)
    assert whole["cu_seq_lens_q"].tolist()[-1] == 78
    assert int((whole["labels"] != -100).sum()) == int((plain["labels"] != -100).sum())
    assert_same_loss_and_gradients(model, plain, whole)
    batch["labels"][1, 1:12] = -100  # a prompt: the head skips it in either layout
    positions = [model_inputs(batch, "varlen", loss_positions=True, whole_rows=whole) for whole in (False, True)]
    assert len(positions[0]["loss_positions"]) == len(positions[1]["loss_positions"]) == 64  # 51 labels, to 16s
    with pytest.raises(ValueError, match="make data.max_seq_len a multiple of 16"):
        model_inputs(batch, "varlen", token_multiple=16, whole_rows=True)  # 78 tokens
    assert model_inputs(batch, "sdpa", whole_rows=True)["input_ids"].shape == (3, 26)  # rows stay rows: one shape


@pytest.mark.parametrize(
    ("setting", "compiled", "attention", "fill", "whole"),
    [
        ("auto", True, "varlen", 1.0, True),
        ("auto", True, "varlen", 0.5, False),  # half the rows padding: computing it costs more than a static graph
        ("auto", False, "varlen", 1.0, False),  # eager layers have no graph to keep
        (True, False, "varlen", 0.5, True),
        (False, True, "varlen", 1.0, False),
        (True, True, "sdpa", 1.0, False),  # rows that keep their padding already have one shape
    ],
)
def test_static_shapes_where_the_setting_and_the_data_ask(setting, compiled, attention, fill, whole):
    from tests.runtime.configs import data_config
    from tigon.runtime.batches import static_shapes
    from tigon.runtime.data import PackedDataset

    config = data_config("train.jsonl", max_seq_len=32)
    config.training.micro_batch_size, config.training.compile = 4, compiled
    config.training.static_shapes, config.model.attn_implementation = setting, attention
    document = int(32 * fill)
    documents = [(list(range(document)), list(range(document)))] * 10
    dataset = PackedDataset(documents, 32, pad_token_id=0, packing=False)  # a document a row
    assert static_shapes(config, dataset) is whole


def test_without_boundaries_rows_attend_as_wholes():
    """No boundaries (rows of one document, or generation): transformers' causal SDPA, as the sdpa model."""
    dense, varlen = tiny()
    ids = packed_batch([[21], [21]])["input_ids"]
    with torch.no_grad():
        assert relative(varlen(input_ids=ids).logits, dense(input_ids=ids).logits) < 1e-6
        generated = varlen.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, dense.generate(ids[:, :5], max_new_tokens=4, do_sample=False))


def test_a_sliding_window_applies_within_each_document():
    """Mistral with a 4-token window: packed documents longer than the window match each one alone."""
    dense, varlen = tiny(MistralForCausalLM, MistralConfig, sliding_window=4)
    batch = packed_batch([[9, 3, 11], [23]])
    with torch.no_grad():
        logits = varlen(**model_inputs(batch, "varlen"), use_cache=False).logits
        alone = dense(input_ids=batch["input_ids"][:1, 12:23]).logits[0]
        assert relative(logits[0, 12:23], alone) < 1e-6
        whole = dense(input_ids=batch["input_ids"][1:]).logits  # one document a row: the window without a mask
        assert relative(varlen(input_ids=batch["input_ids"][1:]).logits, whole) < 1e-6

        def cached(model):  # generation: 3 tokens after a 9-token prompt, the window over the cache
            cache = model(input_ids=batch["input_ids"][1:, :9], use_cache=True).past_key_values
            return model(input_ids=batch["input_ids"][1:, 9:12], past_key_values=cache, use_cache=True).logits

        assert relative(cached(varlen), cached(dense)) < 1e-6


def test_padding_before_tokens_is_refused():
    """A right-padded row needs no mask under causal attention; left padding would need one, so it fails."""
    dense, varlen = tiny()
    ids = packed_batch([[9], [9]])["input_ids"]
    right = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    with torch.no_grad():
        out = varlen(input_ids=ids, attention_mask=right).logits
        assert relative(out[1, :6], dense(input_ids=ids, attention_mask=right).logits[1, :6]) < 1e-6
        with pytest.raises(ValueError, match="padding before tokens: pad on the right"):
            varlen(input_ids=ids, attention_mask=right.flip(-1))


def test_softcapping_is_refused_with_the_fix():
    from tigon.runtime.attention import varlen_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcapping .* model.attn_implementation: eager"):
        varlen_attention(torch.nn.Module(), q, q, q, None, softcap=50.0)


def test_every_trainer_trains_packed_rows_through_varlen(tmp_path):
    """The torch trainer, HF Trainer and Lightning with model.attn_implementation: varlen reach the losses of the
    dense-mask run: each builds the model with tigon's attention and hands it the boundaries (model_inputs)."""
    pytest.importorskip("lightning")
    from tests.runtime.configs import adapter_config
    from tests.runtime.worker_groups import RELATIVE_TOLERANCE
    from tigon.runtime.data import build_datasets, single_documents
    from tigon.runtime.tokenizer import load_tokenizer
    from tigon.runtime.trainer import train

    def config(trainer: str, attention: str):
        run_dir = str(tmp_path / f"run-{trainer}-{attention}")
        return adapter_config(tmp_path, trainer, model={"attn_implementation": attention}, logging={"run_dir": run_dir})

    reference = config("torch", "sdpa")
    dataset, _, _ = build_datasets(reference, load_tokenizer(reference.model))
    assert not single_documents(dataset.position_ids)  # rows hold several documents
    expected = train(reference).losses
    for trainer in ("torch", "hf", "lightning"):
        losses = train(config(trainer, "varlen")).losses
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
        assert len(losses) == 6 and worst < RELATIVE_TOLERANCE, (trainer, worst, losses, expected)


def test_a_checkpoint_resumes_under_another_attention(tmp_path):
    """Every attention implementation computes the same function: a run saved under sdpa resumes under auto."""
    from tests.runtime.configs import tiny_config
    from tigon.runtime.config import ConfigError
    from tigon.runtime.run import check_resumable

    saved = tiny_config(tmp_path, model={"attn_implementation": "sdpa"})
    (tmp_path / "config.json").write_text(saved.model_dump_json())
    check_resumable(tmp_path, tiny_config(tmp_path, model={"attn_implementation": "auto"}))
    with pytest.raises(ConfigError, match="different model settings"):
        check_resumable(tmp_path, tiny_config(tmp_path, model={"dtype": "bfloat16"}))
