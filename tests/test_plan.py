"""``fledge plan``: each term of the memory model against the code that allocates it (the autograd graph's saved
tensors, a live-memory trace of a real step, a written shard, the modules' parameters), the sharding of each
ZeRO stage, the CLI for every preset, the impossible job, and bad input. The 8B check against a measured step is
``fledge bench plan``; a smaller one is the slow test at the end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from fledge.core.dist import DistInfo
from fledge.core.errors import ConfigError
from fledge.launch.cli import compose_config
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.shapes import KNOWN_SHAPES, VerifierShape, read_gguf_header, resolve_shape, shape_from_gguf
from fledge.models.verifier import VerifierConfig, embedded_gguf
from fledge.plan.bench import PlanBenchConfig, draft_of
from fledge.plan.bench import run as bench_run
from fledge.plan.fake import fake_step
from fledge.plan.step import LiveBytes, built_step, run_step
from fledge.plan.job import JobPlan, estimate_data, make_plan
from fledge.plan.memory import (
    GIB,
    REDUCE_BUCKET,
    JobShape,
    cache_bytes_per_token,
    draft_flops,
    draft_params,
    peak_memory,
    trainable_params,
    ttt_saved_bytes,
    verifier_flops,
)
from fledge.train.bench import synthetic_head, synthetic_states
from fledge.train.config import TrainConfig
from fledge.train.engine import EngineConfig, TorchEngine, TTTModule
from fledge.train.ttt import TTTConfig, ttt_forward

pytestmark = pytest.mark.usefixtures("one_thread")

PRESETS = ["llama3.1-8b-instruct", "llama3.3-70b-instruct", "qwen3-30b-a3b", "qwen3-8b"]
LLAMA_8B = KNOWN_SHAPES["meta-llama/Llama-3.1-8B-Instruct"]


def tiny(heads: int = 4, kv_heads: int = 2, hidden: int = 64, head_dim: int = 24) -> Eagle3Config:
    return Eagle3Config(hidden_size=hidden, intermediate_size=176, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=500, draft_vocab_size=100,
                        target_hidden_size=40)


def synthetic(c: Eagle3Config, b: int, t: int, seed: int = 0) -> tuple[Eagle3Draft, torch.Tensor, dict]:
    """The inputs `fledge bench train` and `fledge bench plan` measure: every position counted."""
    gen = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(c, seed=seed)
    return draft, synthetic_head(c, gen), synthetic_states(c, b, t, gen)


def saved_by_autograd(loss: torch.Tensor, known: set[int]) -> int:
    """Bytes of the distinct storages the graph under ``loss`` keeps for its backward, except ``known`` ones."""
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_") and name != "saved_tensors":  # the latter: custom autograd functions
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:
                continue
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("attention", ["flash", "blocks"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", [(2, 4, 2), (1, 6, 3), (3, 4, 4), (1, 4, 4), (1, 4, 1), (2, 4, 1)],
                         ids=["gqa-b2", "gqa-b1", "mha-b3", "mha-b1", "mqa-b1", "mqa-b2"])
def test_saved_activations_are_the_bytes_autograd_keeps(dtype, layout, attention):
    """The activation term, term by term, is what the real TTT forward's graph holds: exactly, in fp32 and under
    bf16 autocast, for batched and single sequences, grouped, multi- and single-key-value-head attention, through
    the flash kernel and through the explicit scores."""
    b, heads, kv_heads = layout
    c = tiny(heads, kv_heads, hidden=48, head_dim=8) if heads == 6 else tiny(heads, kv_heads)
    for steps in (1, 3):
        draft, head, batch = synthetic(c, b, 24)
        known = {t.untyped_storage().data_ptr() for t in [*draft.parameters(), *draft.buffers(), *batch.values(), head]}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss, metrics = ttt_forward(draft, batch, head, TTTConfig(ttt_steps=steps, attention=attention))
        assert float(metrics["tokens"]) == b * (24 - 2)  # every position counted, as the plan assumes
        job = JobShape(c, VerifierShape(), b, 24, steps, dtype, attention=attention)
        assert saved_by_autograd(loss, known) == sum(ttt_saved_bytes(job).values())


@pytest.mark.parametrize("dtype,batch_size,steps,loss_chunk",
                         [("fp32", 2, 3, 1024), ("fp32", 1, 7, 1024), ("bf16", 1, 4, 1024), ("fp32", 2, 3, 100),
                          ("bf16", 1, 4, 100)])
def test_the_peak_is_the_live_memory_of_a_training_step(dtype, batch_size, steps, loss_chunk):
    """The whole prediction for one process (weights, AdamW's moments, teacher head, batch, activations, gradients
    and temporaries at the peak) against the live bytes of a real step: forward, backward, clip, AdamW."""
    c = Eagle3Config(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=32, vocab_size=8000, draft_vocab_size=2000, target_hidden_size=256)
    draft, head, batch = synthetic(c, batch_size, 192)
    module = TTTModule(draft, head, TTTConfig(ttt_steps=steps, loss_chunk=loss_chunk))
    del head  # as train/loop.py: the module's split of it is the teacher's head
    engine = TorchEngine(module, TrainConfig(max_steps=2, dtype=dtype, warmup_steps=0), EngineConfig(), DistInfo(),
                         torch.device("cpu"), 2)
    for p in engine.params:  # AdamW's moments exist from its first step on
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    tracker = LiveBytes()
    for t in [*draft.parameters(), *draft.buffers(), *batch.values(), module.teacher.inside, module.teacher.outside]:
        tracker.add(t)
    for state in engine.optimizer.state.values():
        for t in state.values():
            tracker.add(t)
    with tracker:
        loss, _ = engine.forward(batch)
        engine.backward(loss, boundary=True)
        engine.step()
    predicted = peak_memory(JobShape(c, VerifierShape(), batch_size, 192, steps, dtype, loss_chunk=loss_chunk), 0, 1,
                            online=False, ddp=False, foreach=False)
    assert predicted.total == pytest.approx(tracker.peak, rel=0.03), predicted.moments


def test_parameter_counts_are_the_modules():
    c = tiny()
    draft = Eagle3Draft(c)
    assert trainable_params(c) == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert draft_params(c)["embedding"] == draft.embed_tokens.weight.numel()
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config

    for tied in (False, True):
        hf = tiny_hf_config("qwen2", vocab_size=300, layers=3)
        hf.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(hf)
        shape = VerifierShape(32, 64, 3, 4, 2, None, 300, tied)
        # Qwen2's attention has biases on q/k/v, which the Llama-style count leaves out
        biases = 3 * (4 * 8 + 2 * 2 * 8)
        assert shape.params() + biases == sum(p.numel() for p in model.parameters())
    assert LLAMA_8B.params() == 8_030_261_248  # Llama-3.1-8B's published count


PERSISTENT = ("verifier_weights", "draft_weights", "frozen_embedding", "teacher_head", "master_weights",
              "optimizer_states", "batch", "engine_buffers")


def test_zero_stages_shard_the_right_terms():
    # the 8B draft (a tiny one would fit DDP better than ZeRO: DeepSpeed's reduction bucket is 1.9 GiB whatever the
    # model, see the last assertions)
    # (2,048 tokens: long enough that ZeRO-1 and -3 peak at the same moment, the end of the forward)
    job = JobShape(draft_of(LLAMA_8B, 32000), LLAMA_8B, 1, 2048, 7, "bf16")
    c = job.draft
    p, trainable = draft_params(c), trainable_params(c)
    world = 8
    mem = {s: peak_memory(job, s, world, online=False) for s in range(4)}
    one = {s: peak_memory(job, s, 1, online=False, ddp=False) for s in range(4)}
    for s in range(4):
        t = mem[s].terms
        # never sharded: the teacher head, the batch, the activations (no stage shards them)
        # (fp32, and under bf16 autocast a bf16 copy of the columns outside the draft vocabulary and their norms)
        outside = c.vocab_size - c.draft_vocab_size
        teacher = 4 * c.vocab_size * c.target_hidden_size + (2 * c.target_hidden_size + 4) * outside
        assert t["teacher_head"] == one[s].terms["teacher_head"] == teacher
        for moment in ("forward end", "backward"):  # what the step adds to the persistent terms there
            added = [m.moments[moment] - sum(m.terms[k] for k in PERSISTENT) for m in (mem[s], one[s])]
            assert added[0] == added[1] > sum(ttt_saved_bytes(job).values())
        assert t["batch"] == one[s].terms["batch"]
        # weights (and the frozen embedding) only under ZeRO-3
        assert t["draft_weights"] == 4 * trainable / (world if s == 3 else 1)
        assert t["frozen_embedding"] == 4 * p["embedding"] / (world if s == 3 else 1)
        # AdamW's two fp32 moments from ZeRO-1 on, and DeepSpeed's fp32 master partition
        assert t["optimizer_states"] == 8 * trainable / (world if s >= 1 else 1)
        assert t["master_weights"] == (4 * trainable / world if s >= 1 else 0)
        assert t["verifier_weights"] == 0
    assert mem[0].terms["engine_buffers"] == 4 * trainable  # DDP's buckets
    assert one[0].terms["engine_buffers"] == 0  # one process: no buckets
    assert mem[0].total > mem[1].total  # AdamW's moments sharded outweigh the reduction bucket at 8B
    # ZeRO-3 shards the weights and the embedding but keeps the bucket and gathers modules: it pays at 70B, where
    # the 70B preset takes it, and not at 8B
    assert mem[3].total - mem[1].total == pytest.approx(
        mem[3].terms["engine_buffers"] - 7 / 8 * 4 * (trainable + p["embedding"]))
    job70 = JobShape(draft_of(KNOWN_SHAPES["meta-llama/Llama-3.3-70B-Instruct"], 32000), LLAMA_8B, 1, 512, 7, "bf16")
    assert peak_memory(job70, 1, world, online=False).total > peak_memory(job70, 3, world, online=False).total
    # the unroll accumulates each weight's gradient over the whole backward: ZeRO-2 holds as much as ZeRO-1 then
    assert mem[1].moments["backward"] == mem[2].moments["backward"]
    online = peak_memory(job, 2, world, online=True)
    assert online.terms["verifier_weights"] == 2 * LLAMA_8B.params()
    assert online.total > mem[2].total + online.terms["verifier_weights"]  # plus the verifier's forward
    # DeepSpeed's reduction bucket: ZeRO-1/2 hold it with the gradients at the end of the backward, ZeRO-3 from the
    # optimizer's creation on (with the flat gradient partitions); one rank of ZeRO-3 gathers nothing
    small = JobShape(tiny(), VerifierShape(), 1, 64, 2, "fp32")
    small_p = trainable_params(small.draft)
    for s in (1, 2):
        m = peak_memory(small, s, world, online=False)
        assert m.moment == "optimizer step" and m.total > peak_memory(small, 0, world, online=False).total
        assert m.terms["step_buffers"] > 4 * REDUCE_BUCKET
    assert peak_memory(small, 3, 1, online=False).terms["engine_buffers"] == 4 * REDUCE_BUCKET + 4 * small_p
    assert peak_memory(small, 3, world, online=False).terms["engine_buffers"] > 4 * REDUCE_BUCKET + 4 * small_p


def test_activations_grow_with_the_micro_batch_and_the_length():
    job = JobShape(Eagle3Config.from_dict({**tiny().to_dict()}), LLAMA_8B, 1, 256, 7, "bf16")
    one, two = (sum(ttt_saved_bytes(dataclasses.replace(job, micro_batch=b)).values()) for b in (1, 2))
    assert two == pytest.approx(2 * one, rel=0.02)
    # the attention's saved tensors grow linearly with the length through the flash kernel, quadratically through
    # the explicit scores
    key = "attention probabilities [T, T+k]"
    for attention, factor in (("flash", 2), ("blocks", 4)):
        short = dataclasses.replace(job, attention=attention)
        long = dataclasses.replace(short, seq_len=512)
        assert ttt_saved_bytes(long)[key] == pytest.approx(factor * ttt_saved_bytes(short)[key], rel=0.02)


def test_cache_bytes_per_token_is_what_a_shard_takes(tmp_path):
    from fledge.data.cache import write_shard

    lengths = [300, 500, 700, 500]
    hidden = 64
    (tmp_path / "shards").mkdir()  # fledge cache makes it before the first shard (data/cache_job.py)
    write_shard(tmp_path, 0, list(range(4)), [torch.zeros(n, dtype=torch.int64) for n in lengths],
                [torch.ones(n, dtype=torch.int64) for n in lengths],
                [torch.zeros(n, 3 * hidden, dtype=torch.bfloat16) for n in lengths],
                [torch.zeros(n, hidden, dtype=torch.bfloat16) for n in lengths])
    size = (tmp_path / "shards" / "shard-00000.safetensors").stat().st_size
    predicted = sum(lengths) * cache_bytes_per_token(hidden, 2) + 16 * len(lengths)
    assert size - 1024 <= predicted <= size  # the rest is the safetensors header
    assert cache_bytes_per_token(4096, 2) == 32 * 1024 + 5


def test_verifier_flops_are_its_forward():
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config

    hf = tiny_hf_config("llama", vocab_size=300, layers=3)
    hf._attn_implementation = "eager"  # plain products, which the counter sees
    model = AutoModelForCausalLM.from_config(hf)
    t = 40
    with FlopCounterMode(display=False) as counter:
        model.model(input_ids=torch.zeros(1, t, dtype=torch.long))
    shape = VerifierShape(32, 64, 3, 4, 2, None, 300, False).complete()
    q = shape.num_attention_heads * shape.head_dim
    causal_to_full = shape.num_hidden_layers * 2 * 2 * q * (t * t - t * (t + 1) / 2)
    assert verifier_flops(shape, t) + causal_to_full == counter.get_total_flops()
    # draft FLOPs are `fledge bench train`'s count; they grow with the unroll and with the loss positions
    c = tiny()
    assert draft_flops(c, 128, 7) > draft_flops(c, 128, 3) > draft_flops(c, 128, 3, loss_fraction=0.5)


# ------------------------------------------------------------------------------------------------------ shapes
def test_gguf_metadata_gives_the_shape_without_the_weights(tmp_path):
    import gguf

    assert shape_from_gguf(embedded_gguf("smollm2-135m-instruct")).complete() == \
        KNOWN_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_embedding_length(96)
    writer.add_feed_forward_length(256)
    writer.add_block_count(5)
    writer.add_head_count(6)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}" for i in range(77)])
    writer.add_tensor("output.weight", torch.zeros(77, 96).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, names = read_gguf_header(path)
    assert names == ["output.weight"] and metadata["general.architecture"] == "qwen2"
    assert shape_from_gguf(path).complete() == VerifierShape(96, 256, 5, 6, 2, 16, 77, False)
    # a mixture of experts (llama.cpp's qwen3moe keys): 8 experts of width 64, 2 per token
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in (("embedding_length", 96), ("feed_forward_length", 256), ("block_count", 5),
                       ("head_count", 6), ("head_count_kv", 2), ("expert_count", 8), ("expert_used_count", 2),
                       ("expert_feed_forward_length", 64)):
        getattr(writer, f"add_{add}")(value)
    writer.add_token_list([f"t{i}" for i in range(77)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    moe = shape_from_gguf(path).complete()
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.num_dense_layers) == (8, 2, 64, 0)
    assert moe.params() - moe.active_params() == 5 * 6 * 3 * 96 * 64 and moe.tie_word_embeddings


def test_shapes_come_from_a_folder_the_table_or_the_user(tiny_verifier_dir):
    shape, source = resolve_shape(VerifierConfig(name_or_path=str(tiny_verifier_dir)), VerifierShape())
    config = json.loads((tiny_verifier_dir / "config.json").read_text())
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (
        config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    assert source.endswith("config.json")
    shape, source = resolve_shape(VerifierConfig(name_or_path="Qwen/Qwen3-8B"), VerifierShape(num_hidden_layers=2))
    assert shape.num_hidden_layers == 2 and shape.vocab_size == 151936 and "given" in source
    with pytest.raises(ConfigError, match=r"missing \['hidden_size'") as err:
        resolve_shape(VerifierConfig(name_or_path="someone/unknown-model"), VerifierShape(vocab_size=1000))
    assert "shape.hidden_size=..." in err.value.fix


# -------------------------------------------------------------------------------------------------- the plan
def plan_of(*overrides: str) -> JobPlan:
    return make_plan(compose_config("plan", list(overrides)))


def test_data_is_counted_and_estimated_from_the_source(tmp_path):
    source = tmp_path / "convs.jsonl"
    records = [{"messages": [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 400}]}] * 6
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = compose_config("plan", [f"data.source={source}", "data.max_length=100"])
    data = estimate_data(cfg)
    assert data.conversations == 6
    assert data.lengths == [min(100, round(440 / 4 + 2 * 5))] * 6
    assert data.loss_fraction == pytest.approx(400 / 440)
    given = estimate_data(dataclasses.replace(cfg, conversations=1000, tokens_per_conversation=50))
    assert (given.conversations, given.tokens_per_conversation) == (1000, 50)
    missing = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=str(tmp_path / "no.jsonl")),
                                  estimate_from=None)
    with pytest.raises(ConfigError, match="does not exist yet"):
        estimate_data(missing)


def test_time_per_epoch_is_flops_over_the_gpus_rate():
    base = ["preset=llama3.1-8b-instruct", "conversations=1000", "tokens_per_conversation=2000", "validation.holdout=0"]
    plan = plan_of(*base)
    draft = Eagle3Config(4096, 14336, 32, 8, 128, 128256, 32000, 4096)
    expected = 1000 * draft_flops(draft, 2000, 7) / (8 * 989e12 * 0.4) / 3600
    assert plan.compute["time_per_epoch_offline_h"] == pytest.approx(expected)
    twice = plan_of(*base, "nodes=2")
    assert twice.compute["time_per_epoch_offline_h"] == pytest.approx(expected / 2)
    assert twice.disk["cache_disk_gib"] == pytest.approx((1000 * 2000 * (32 * 1024 + 5) + 16 * 1000) / GIB)


def test_the_plan_file_reads_back_through_its_type(tmp_path):
    plan = plan_of("preset=qwen3-8b", "conversations=100", "tokens_per_conversation=500")
    file = plan.save(tmp_path)
    raw = json.loads(file.read_text())
    assert file.name == "plan.json" and raw["format"] == JobPlan.FORMAT
    assert JobPlan.load(tmp_path).to_json() == raw == json.loads(json.dumps(plan.to_json()))
    older = {k: v for k, v in raw.items() if k != "format"}  # written before plans had a format
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert JobPlan.load(tmp_path / "older.json").recommendation == raw["recommendation"]
    for name, bad in (("later", {**raw, "format": JobPlan.FORMAT + 1}), ("other", {"sets": {}})):
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"{name}.json is not a fledge plan this fledge reads .*up to 1"):
            JobPlan.load(tmp_path / f"{name}.json")


def test_the_regeneration_is_priced_by_its_decoding_step():
    base = ["preset=llama3.1-8b-instruct", "conversations=1000", "tokens_per_conversation=2000", "regenerate=true"]
    r = plan_of(*base).regeneration
    # given tokens count as answers (loss share 1); Llama-3.1-8B's KV cache: 2 x 32 layers x 8 heads x 128 x 2 bytes
    assert r["answer_tokens"] == 2_000_000 and r["prompt_tokens"] == 0
    assert r["kv_bytes_per_token"] == 131_072
    assert (r["gpus_per_replica"], r["replicas"], r["sequences"]) == (1, 8, 64)  # 16 GB of weights fit one GPU
    weights = 2 * 8_030_261_248
    step = (weights + 64 * 1000 * 131_072) / (3.35e12 * 0.7)  # memory-bound: each step reads weights and KV once
    assert r["bound"] == "memory" and r["step_ms"] == pytest.approx(1e3 * step)
    assert r["hours"] == pytest.approx(2_000_000 / (8 * 64 / step) / 3600)
    assert r["overrides"] == ("regenerate.engine=vllm regenerate.vllm_tensor_parallel_size=1 "
                              "regenerate.vllm_data_parallel_size=8 regenerate.batch_size=64")
    # twice the bandwidth, half the step; a larger batch reads the weights once for more tokens
    assert plan_of(*base, "memory_bandwidth_tbs=6.7").regeneration["step_ms"] == pytest.approx(r["step_ms"] / 2)
    wide = plan_of(*base, "regenerate_batch=256").regeneration
    assert wide["sequences"] == 256 and wide["tokens_per_s"] > 1.5 * r["tokens_per_s"]
    # as many as the KV cache holds, at most
    assert plan_of(*base, "regenerate_batch=100000").regeneration["sequences"] == r["sequences_that_fit"] < 100000
    # 70B in bf16 (141 GB) takes 4 GPUs of 80 GiB a replica (half of the memory left for the KV cache)
    big = plan_of("preset=llama3.3-70b-instruct", "conversations=1000", "tokens_per_conversation=2000",
                  "regenerate=true").regeneration
    assert big["gpus_per_replica"] == 4 and big["replicas"] == 8 // 4
    assert "vllm_tensor_parallel_size=4 regenerate.vllm_data_parallel_size=2" in big["overrides"]
    # a mixture of experts reads all its weights but computes with the active ones only
    moe = plan_of("preset=qwen3-30b-a3b", "conversations=1000", "tokens_per_conversation=2000", "regenerate=true",
                  "regenerate_batch=2048", "memory_bandwidth_tbs=1000").regeneration
    assert moe["bound"] == "compute"
    compute = 2 * 3_353_020_416 * moe["sequences"] / (moe["gpus_per_replica"] * 989e12 * 0.4)
    assert moe["step_ms"] == pytest.approx(1e3 * compute)


def test_the_plan_regenerates_only_answers_that_do_not_exist_yet(tmp_path):
    # the presets train on what regenerate writes: while it does not exist, the plan prices writing it
    preset = plan_of("preset=qwen3-8b", "conversations=100", "tokens_per_conversation=500")
    assert preset.regeneration is None  # both sizes given: nothing stood in for the source
    estimated = plan_of("preset=qwen3-8b", "data.max_conversations=50")
    assert estimated.regeneration is not None and estimated.compute["regenerate_h"] == estimated.regeneration["hours"]
    assert plan_of("preset=qwen3-8b", "data.max_conversations=50", "regenerate=false").regeneration is None
    source = tmp_path / "convs.jsonl"
    record = {"messages": [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 400}]}
    source.write_text((json.dumps(record) + "\n") * 4)
    assert plan_of(f"data.source={source}").regeneration is None
    with pytest.raises(ConfigError, match="bandwidth_share"):
        plan_of("bandwidth_share=0")


LONG = "data.max_length=16384"


def test_a_job_too_large_for_its_gpus_says_so_and_names_what_fits():
    # 16,384-token sequences: offline, 80 GiB GPUs hold a 70B draft's step up to about 11k tokens (the TTT attention
    # keeps no [T, T] tensor), so the job needs larger GPUs or a shorter length
    plan = plan_of("preset=llama3.3-70b-instruct", "mode=online", "conversations=1000",
                   "tokens_per_conversation=2000", LONG)
    rec = plan.recommendation
    assert not rec["fits"] and rec["mode"] == "online"
    text = "\n".join(rec["what_would_fit"])
    assert "the verifier alone takes 131.4 GiB" in text and "over 2 GPUs per replica" in text
    assert "verifier.device_map=auto" in text
    # online no length fits (the verifier's 131 GiB exceed 76 usable GiB whatever the draft needs): the plan must
    # not offer one, and names the offline job instead
    assert not [line for line in rec["what_would_fit"] if line.startswith("data.max_length=")]
    assert "no data.max_length or micro-batch fits online" in text
    assert "GPUs of at least" in text and "more GPUs do not help" in text
    offline_line = next(line for line in rec["what_would_fit"] if line.startswith("offline it does not fit either"))
    offline_length = int(offline_line.split("offline data.max_length=")[1].split()[0])
    # offline, the same job fits 141 GiB GPUs, and the suggested length is the longest that fits 80 GiB ones
    assert plan_of("preset=llama3.3-70b-instruct", "conversations=1000", "tokens_per_conversation=2000", LONG,
                   "gpu_memory_gib=141").recommendation["fits"]
    offline = plan_of("preset=llama3.3-70b-instruct", "conversations=1000", "tokens_per_conversation=2000", LONG)
    assert not offline.recommendation["fits"]
    length = int(next(line for line in offline.recommendation["what_would_fit"]
                      if line.startswith("data.max_length=")).split()[0].split("=")[1])
    assert length == offline_length  # the online plan's offline alternative is the offline plan's
    at = plan_of("preset=llama3.3-70b-instruct", "conversations=1000", "tokens_per_conversation=2000",
                 f"data.max_length={length}")
    above = plan_of("preset=llama3.3-70b-instruct", "conversations=1000", "tokens_per_conversation=2000",
                    f"data.max_length={length + 1}")
    assert at.memory["offline"]["zero3"]["fits"] and not above.memory["offline"]["zero3"]["fits"]


def fledge(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "fledge.launch.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


LABELS = ("cache_bytes_per_token", "cache_disk_gib", "total_offline_gib", "total_online_gib", "fits_offline",
          "draft_flops_per_token", "time_per_epoch_offline_h", "time_per_epoch_online_h", "recommended_mode",
          "recommended_fits", "regenerate_tokens_per_s", "regenerate_h")


@pytest.mark.parametrize("preset", PRESETS)
def test_the_cli_prints_the_plan_of_each_preset(preset, tmp_path):
    done = fledge("plan", f"preset={preset}", f"out_dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.startswith("  ")
            and line.split()}
    assert all(label in rows for label in LABELS), done.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == JobPlan.FORMAT
    plan = JobPlan.load(tmp_path)  # read back through its type
    assert rows["total_offline_gib"] == [f"{plan.memory['offline'][f'zero{s}']['total_gib']:.2f}" for s in range(4)]
    assert rows["recommended_mode"] == [plan.recommendation["mode"]]
    assert plan.data["conversations"] > 10_000  # ShareGPT stands in for regenerate's answers
    hidden = {"llama3.3-70b-instruct": 8192, "qwen3-30b-a3b": 2048}.get(preset, 4096)
    assert int(rows["cache_bytes_per_token"][0].replace(",", "")) == 4 * hidden * 2 + 5
    assert rows["recommended_fits"] == ["yes"]
    if preset == "qwen3-30b-a3b":  # a mixture of experts: memory of every parameter, FLOPs of the active ones
        assert "128 experts of MLP 768, 8 per token" in done.stdout and "3.35 B active per token" in done.stdout
        assert plan.verifier["params"] == 30_532_110_336 and plan.verifier["active_params"] == 3_353_020_416


def test_bad_input_is_one_line_and_status_2():
    unknown = fledge("plan", "preset=llama4-400b")
    assert unknown.returncode == 2
    [line] = [ln for ln in unknown.stderr.splitlines() if "error" in ln]
    assert line.startswith("fledge plan: error:") and "qwen3-8b" in line
    for bad, field_ in (("nodes=0", "nodes (0)"), ("gpus_per_node=-1", "gpus_per_node (-1)"), ("mfu=2", "mfu")):
        done = fledge("plan", bad, "conversations=10", "tokens_per_conversation=10")
        assert done.returncode == 2, done.stderr
        [line] = [ln for ln in done.stderr.splitlines() if "error" in ln]
        assert line.startswith("fledge plan: error:") and field_ in line and "Traceback" not in done.stderr


@pytest.mark.slow
def test_bench_plan_predicts_a_measured_step_within_15_percent(capsys):
    """The prediction of what a real step adds to the persistent tensors, against the step's peak resident memory
    above its baseline in a fresh process (and against its live tensor bytes), at a smaller draft than 8B's (the
    8B figure is `fledge bench plan`'s)."""
    result = bench_run(PlanBenchConfig(
        shape=VerifierShape(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=128, vocab_size=32064),
        draft_vocab_size=8000, seq_len=512, threads=1,
    ))
    assert abs(result["error_pct"]) <= 15, result
    assert abs(result["traced_error_pct"]) <= 3, result  # the trace sees the tensors alone: the model's own terms
    assert abs(result["total_error_pct"]) <= 15, result
    out = capsys.readouterr().out
    assert "plan_memory_error_pct" in out and "plan_memory_measured_gib" in out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_fake_step_holds_what_the_real_one_holds(dtype):
    """Under fake tensors, with the data-dependent ops answered from the calibration at 64 and 128 tokens, a step
    allocates what the real step allocates, byte for byte: at 1,300 tokens (the loss's chunks of 1,024 positions run
    twice) and with a batch of two."""
    config = Eagle3Config(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                          head_dim=16, vocab_size=700, draft_vocab_size=300, target_hidden_size=96)
    for length in (200, 1300):
        engine, batch, tracker, persistent = built_step(config, 2, length, 3, 0, dtype)
        with tracker:
            run_step(engine, batch)
        fake = fake_step(config, 2, length, 3, 0, dtype, torch_tracker=True)
        # PyTorch's own MemTracker, watching the same fake step, counts the same total.
        assert fake == {"step_bytes": tracker.peak, "persistent_bytes": persistent,
                        "torch_peak_bytes": persistent + tracker.peak}, length


def test_bench_plan_checks_the_plan_at_shapes_no_cpu_holds(capsys):
    """An 8B draft at 8,192 tokens (over 37 GiB in fp32) runs as a fake step; the plan's total is within 1 %."""
    result = bench_run(PlanBenchConfig(fake=True, seq_len=8192))
    assert result["seq_len"] == 8192 and result["fake_total_gib"] > 30
    assert abs(result["total_error_pct"]) < 1, result
    assert abs(result["torch_tracker_error_pct"]) < 1, result  # torch's MemTracker on the same step
    out = capsys.readouterr().out
    assert "plan_fake_total_error_pct" in out and "plan_fake_total_gib" in out
    assert "plan_fake_torch_tracker_gib" in out
    with pytest.raises(ConfigError, match="bf16 with fake=true"):
        PlanBenchConfig(dtype="bf16")
