"""`training.compile`: each decoder layer compiled, tigon's kernels inside, the same per-step losses as eager.

The CPU tests compile with the `aot_eager` backend: Dynamo and AOTAutograd trace each layer (the kernels as
custom ops, through their fake implementations) and the traced graph runs on PyTorch's own CPU ops, so a
compiled fp32 run computes what the eager run does. Inductor, the default, builds C++ with gcc on the CPU, which
for the tiny Llama's forward and backward graphs takes about as much CPU time as a whole test here should; the
GPU benchmark (`bash benchmarks/gpu_run.sh compile`) runs it. AOTAutograd may decompose an op's backward into other ops,
whose fp32 sums round differently, so the losses are compared within 1e-6 relative (measured: equal).
Across processes the tolerance is the parallel tests' (the all-reduce sums in another order).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.runtime.configs import COMPILED, TINY_MODEL, resumable_config, tiny_config
from tests.runtime.worker_groups import RELATIVE_TOLERANCE, WORKER, launch, worst_relative
from tigon.runtime.config import ConfigError
from tigon.runtime.model import build_model
from tigon.runtime.trainer import train

EXACT = 1e-6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_layers_with_kernels_and_partial_checkpointing_train_as_eager(tmp_path):
    """Layer 0 recomputes in the backward, layer 1 keeps its activations: both compile, with no graph break."""
    training = {"max_steps": 2, "micro_batch_size": 2, "gradient_checkpointing": True, "checkpoint_layers": 1}
    # the fused loss sits outside the layers, and the Triton interpreter runs it slowly: the layers' kernels only
    sections = dict(
        kernels={"enabled": True, "fused_linear_cross_entropy": False}, eval={"metrics": []}, data={"max_seq_len": 24}
    )
    eager = train(tiny_config(tmp_path / "eager", training=training, **sections))
    assert counters["stats"]["unique_graphs"] == 0
    compiled = train(tiny_config(tmp_path / "compiled", training={**training, **COMPILED}, **sections))
    assert counters["stats"]["unique_graphs"] >= 1  # the layers ran compiled
    assert dict(counters["graph_break"]) == {}
    assert worst_relative(compiled.losses, eager.losses) < EXACT, (compiled.losses, eager.losses)


def test_a_patched_decoder_layer_compiles_as_one_graph(tmp_path):
    """The layer whole, tigon's norms, RoPE and gated MLP inside: `fullgraph=True` fails at any graph break."""
    config = tiny_config(tmp_path, training={"gradient_checkpointing": True, **COMPILED}, kernels={"enabled": True})
    model = build_model(config, 64).train()
    assert set(model.tigon_patch_report.applied) >= {"rms_norm", "rope", "gated_mlp"}
    layers = model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    eager = build_model(tiny_config(tmp_path, training={"gradient_checkpointing": True}, kernels={"enabled": True}), 64)
    assert list(model.state_dict()) == list(eager.state_dict())  # compiled in place: the same names
    hidden = torch.randn(2, 9, 32, requires_grad=True)
    positions = torch.arange(9).expand(2, 9)
    rotary = model.model.rotary_emb(hidden, positions)
    layer = layers[0]
    whole = torch.compile(layer.forward, backend="aot_eager", fullgraph=True)
    out = whole(hidden, position_embeddings=rotary, position_ids=positions, use_cache=False)
    layer._compiled_call_impl = None
    expected = layer(hidden, position_embeddings=rotary, position_ids=positions, use_cache=False)
    assert (out - expected).abs().max().item() <= EXACT * expected.abs().max().item()


def test_compiled_layers_compute_the_last_ones_loss_rows_as_eager(tmp_path, monkeypatch):
    """With the fused loss skipping the prompts, the last compiled layer computes only the rows with a loss, with
    no graph break, and trains as the eager layers do."""
    from tigon.kernels.patching import last_layer

    rows_taken = []
    rows_forward = last_layer.loss_rows_forward

    def counting(original):
        forward = rows_forward(original)

        def run(self, hidden_states, *args, **kwargs):
            out = forward(self, hidden_states, *args, **kwargs)
            rows_taken.append(out.shape[1] < hidden_states.shape[1])
            return out

        return run

    monkeypatch.setattr(last_layer, "loss_rows_forward", counting)
    last_layer.loss_rows_class.cache_clear()
    training = {"max_steps": 2, "micro_batch_size": 2}
    sections = dict(kernels={"enabled": True}, eval={"metrics": []}, data={"max_seq_len": 24})
    eager = train(tiny_config(tmp_path / "eager", training=training, **sections))
    assert any(rows_taken)
    rows_taken.clear()
    compiled = train(tiny_config(tmp_path / "compiled", training={**training, **COMPILED}, **sections))
    last_layer.loss_rows_class.cache_clear()
    assert any(rows_taken)
    assert counters["stats"]["unique_graphs"] >= 1 and dict(counters["graph_break"]) == {}
    assert worst_relative(compiled.losses, eager.losses) < EXACT, (compiled.losses, eager.losses)


@pytest.mark.parametrize("trainer", ["torch", "hf", "lightning"])
def test_static_shapes_feed_compiled_layers_one_token_count_with_the_same_losses(tmp_path, monkeypatch, trainer):
    """`training.static_shapes`: under varlen attention every micro-batch keeps its rows whole, so the compiled
    layers see one token count, and the run trains as the one that drops each row's padding, in every trainer."""
    from tigon.runtime import batches, hf_trainer

    token_counts = []
    made = batches.model_inputs

    def recording(*args, **kwargs):
        inputs = made(*args, **kwargs)
        token_counts.append(inputs["input_ids"].shape[1])
        return inputs

    monkeypatch.setattr(batches, "model_inputs", recording)
    monkeypatch.setattr(hf_trainer, "model_inputs", recording)
    training = {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 2, **COMPILED}
    sections = dict(
        trainer=trainer, model={"attn_implementation": "varlen"}, eval={"metrics": []}, data={"max_seq_len": 32}
    )
    runs, counts = {}, {}
    for setting in (False, True):
        token_counts.clear()
        config = tiny_config(tmp_path / str(setting), training={**training, "static_shapes": setting}, **sections)
        runs[setting], counts[setting] = train(config).losses, list(token_counts)
    assert len(set(counts[False])) > 1  # each row's padding dropped: the count changes
    assert set(counts[True]) == {64} and len(counts[True]) >= 6  # 2 rows of 32 in each of six micro-batches
    assert worst_relative(runs[True], runs[False]) < EXACT, runs


def backward_products(model, batch) -> int:
    """How many matrix products the backward of one step runs (through the profiler: compiled code's higher-order
    operators included)."""
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss.backward()
    return sum(event.count for event in profile.key_averages() if event.key in ("aten::mm", "aten::addmm"))


def test_a_compiled_checkpointed_layer_recomputes_only_what_its_backward_reads(tmp_path):
    """The checkpoint sits inside the compiled forward on every transformers release (4.x's checkpoints `__call__`,
    outside it, and its recompute ran the whole compiled forward again), so AOTAutograd's partitioner recomputes
    only what the backward reads: not down_proj's product, whose output nothing reads. Each tiny Llama layer: its 7
    products' two gradients and 6 products again; the head: its input's and weight's gradients."""
    training = {"gradient_checkpointing": True, **COMPILED}
    sections = dict(kernels={"enabled": True, "fused_linear_cross_entropy": False})
    compiled = build_model(tiny_config(tmp_path, training=training, **sections), 64).train()
    assert backward_products(compiled, torch.randint(0, 64, (2, 9))) == 2 * (2 * 7 + 6) + 2


def test_compiled_layers_with_lora_train_as_eager(tmp_path):
    sections = dict(lora={"enabled": True, "r": 4}, eval={"metrics": []})
    training = {"max_steps": 2, "gradient_checkpointing": True}
    eager = train(tiny_config(tmp_path / "eager", training=training, **sections))
    compiled = train(tiny_config(tmp_path / "compiled", training={**training, **COMPILED}, **sections))
    assert counters["stats"]["unique_graphs"] >= 1
    assert dict(counters["graph_break"]) == {}
    assert worst_relative(compiled.losses, eager.losses) < EXACT, (compiled.losses, eager.losses)


def test_compiled_layers_under_ddp_and_fsdp2_match_one_eager_process(tmp_path):
    """2 ranks over gloo, micro-batch 2 each, against one eager process with micro-batch 4: DDP with partial
    checkpointing, FSDP2 (each compiled layer sharded) with checkpointing on and with it off, the HF Trainer
    under FSDP2, Lightning under DDP, and DeepSpeed ZeRO-2. Each rank also reports Dynamo's counts: graphs
    compiled (the runs of a group share Dynamo's cache) and graph breaks."""
    ddp = {**COMPILED, "gradient_checkpointing": True, "checkpoint_layers": 1}
    record = '"eval": result.eval_metrics}'
    assert record in WORKER
    counting = WORKER.replace(record, '"eval": result.eval_metrics, **compiled()}').replace(
        "out = sys.argv[1]\n",
        "out = sys.argv[1]\nfrom torch._dynamo.utils import counters\n"
        "def compiled():\n"
        "    return {'graphs': counters['stats']['unique_graphs'], 'breaks': sum(counters['graph_break'].values())}\n",
    )
    runs = launch(
        tmp_path,
        {
            "ddp": resumable_config(tmp_path, "ddp", 4, False, training=ddp),
            "fsdp": resumable_config(tmp_path, "fsdp", 4, False, training=COMPILED, parallelism={"strategy": "fsdp"}),
            "fsdp-checkpointed": resumable_config(
                tmp_path,
                "fsdp-checkpointed",
                4,
                False,
                training={**COMPILED, "gradient_checkpointing": True},
                parallelism={"strategy": "fsdp"},
            ),
            "hf-fsdp": resumable_config(
                tmp_path, "hf-fsdp", 4, False, trainer="hf", training=COMPILED, parallelism={"strategy": "fsdp"}
            ),
            "lightning-ddp": resumable_config(tmp_path, "lightning-ddp", 4, False, trainer="lightning", training=ddp),
            "zero2": resumable_config(
                tmp_path, "zero2", 4, False, training=COMPILED, parallelism={"strategy": "deepspeed", "zero_stage": 2}
            ),
        },
        worker_source=counting,
    )
    assert runs["ddp"]["graphs"] >= 1 and runs["fsdp-checkpointed"]["graphs"] > runs["ddp"]["graphs"], runs
    assert all(run["breaks"] == 0 for run in runs.values()), runs
    single = train(resumable_config(tmp_path, "single", 4, False, training={"micro_batch_size": 4}))
    for name, run in runs.items():
        worst = worst_relative(run["losses"], single.losses)
        print(f"{name}: worst relative loss difference to one eager process {worst:.2e}")
        assert worst < RELATIVE_TOLERANCE, (name, run["losses"], single.losses)


def test_compile_under_zero3_is_refused_with_the_fix(tmp_path):
    """ZeRO-3's weight-gathering hooks are compiler-disabled: Dynamo breaks the layer at each submodule."""
    with pytest.raises(ConfigError, match="training.compile with DeepSpeed ZeRO-3.*training.compile: false"):
        tiny_config(tmp_path, training={"compile": True}, parallelism={"strategy": "deepspeed", "zero_stage": 3})


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_the_hf_trainer_and_lightning_train_compiled_layers_as_eager(tmp_path, trainer):
    sections = dict(trainer=trainer, eval={"metrics": []})
    eager = train(tiny_config(tmp_path / "eager", training={"max_steps": 2}, **sections))
    compiled = train(tiny_config(tmp_path / "compiled", training={"max_steps": 2, **COMPILED}, **sections))
    assert counters["stats"]["unique_graphs"] >= 1 and dict(counters["graph_break"]) == {}
    assert worst_relative(compiled.losses, eager.losses) < EXACT, (compiled.losses, eager.losses)


def test_an_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="training.compile_backend"):
        tiny_config(tmp_path, training={"compile": True, "compile_backend": "cudagraphs"})


def test_the_planner_counts_a_compiled_layers_gated_activation_backward_out_of_place(tmp_path):
    """Compiled code runs tigon's SwiGLU backward out of place: 3 c i bytes a token, not the in-place c i. The tiny
    Llama (fp32, c = 4; i = 64; q = 2 heads x 16 = 32): in place, attention's 3 c q + 4 q = 512 is the larger."""
    from tigon.runtime import planner

    kernels = {"enabled": True}
    eager = planner.workload(tiny_config(tmp_path, kernels=kernels), world_size=1)
    compiled = planner.workload(tiny_config(tmp_path, training={"compile": True}, kernels=kernels), world_size=1)
    assert (eager.compiled, compiled.compiled) == (False, True)
    assert planner.layer_backward_bytes(eager, kernels=True) == 3 * 4 * 32 + 4 * 32
    assert planner.layer_backward_bytes(compiled, kernels=True) == 3 * 4 * 64
    assert planner.layer_backward_bytes(compiled, kernels=False) == planner.layer_backward_bytes(eager, kernels=False)


@pytest.mark.parametrize("compiled", [False, True])
def test_softcapped_eager_attention_gets_the_compile_hint_unless_compiled(tmp_path, caplog, compiled):
    model = {
        "config_name": "gemma2",
        "config_overrides": {**TINY_MODEL, "head_dim": 16, "query_pre_attn_scalar": 16},
        "attn_implementation": "eager",
    }
    config = tiny_config(tmp_path, model=model, training=COMPILED if compiled else {})
    with caplog.at_level("INFO", logger="tigon.runtime"):
        build_model(config, vocab_size=64)
    assert ("training.compile: true fuses them" in caplog.text) is not compiled


def tiny_qwen3_next(tmp_path, training: dict):
    """Qwen3-Next at tiny widths: a Gated DeltaNet layer, then an attention one."""
    deltanet = dict(
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )
    model = {"config_name": "qwen3_next", "config_overrides": {**TINY_MODEL, "head_dim": 16, **deltanet}}
    return tiny_config(tmp_path, model=model, training=training)


@pytest.mark.parametrize("compiled", [False, True])
def test_gated_deltanet_layers_get_the_compile_hint_unless_compiled(tmp_path, caplog, compiled):
    """Qwen3-Next's Gated DeltaNet layers run transformers' PyTorch recurrence where flash-linear-attention is not
    installed (as here). (Built only: Inductor compiles at the first call.)"""
    config = tiny_qwen3_next(tmp_path, {"compile": True} if compiled else {})
    with caplog.at_level("INFO", logger="tigon.runtime"):
        build_model(config, vocab_size=64)
    assert ("Gated DeltaNet layers run transformers' PyTorch recurrence" in caplog.text) is not compiled


def test_aot_eager_on_gated_deltanet_layers_is_refused_with_the_fix_while_pytorch_needs_it(tmp_path):
    """This PyTorch's fake softplus_backward strides differ from its kernel's (the check fails once PyTorch agrees:
    then the refusal and tests/kernels/test_compile.py's expected failures go)."""
    from tigon.runtime.model import softplus_backward_strides_agree

    assert not softplus_backward_strides_agree()
    with pytest.raises(ConfigError, match="compile_backend: inductor .* or training.compile: false"):
        build_model(tiny_qwen3_next(tmp_path, COMPILED), vocab_size=64)


def test_sdpa_attention_gets_no_compile_hint(tmp_path, caplog):
    with caplog.at_level("INFO", logger="tigon.runtime"):
        build_model(tiny_config(tmp_path), vocab_size=64)
    assert "training.compile: true fuses" not in caplog.text
