"""Decode CUDA graphs (refengine/model/cuda_graphs.py).

On the CPU: the padded sizes, the eligibility rules, the padded buffers, that a CPU runner
never builds graphs (and ``--no-cuda-graphs`` reaches the runner), and the whole replay
flow, buffers and the torch reference's graph mode included, with an eager stand-in for
the CUDA graph recorder (a "replay" reruns the recorded forward over the same buffers).
On CUDA (``@pytest.mark.gpu``): captured graphs give the same greedy tokens as eager steps.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import pytest
import torch

from refengine.args import add_engine_args
from refengine.args_config import engine_config_from_args
from refengine.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
from refengine.kernels.attention import AttentionBackend, AttentionMetadata, TorchReferenceBackend
from refengine.model.cuda_graphs import (
    DecodeGraphs,
    graph_sizes,
    graphs_unavailable_reason,
    padded_decode,
    padded_size,
    step_ineligible_reason,
)
from refengine.model.input import ModelInput
from refengine.model.runner import ModelRunner, make_runner
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf

BLOCK = 4
NUM_BLOCKS = 64
SCRATCH = NUM_BLOCKS - 1  # on CPU the tests give the graphs the pool's last block (no sequence uses it)
BLOCKS_PER_SEQ = 8  # sequence i owns blocks i*8 .. i*8+7
MAX_LEN = 64
CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False): CUDA graphs cannot be captured on the CPU"


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(max_position_embeddings=MAX_LEN)
    return model_config_from_hf(model), hf_weights(model)


# ----------------------------------------------------------------------------- sizes and eligibility


@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (9, (1, 2, 4, 8, 9)), (16, (1, 2, 4, 8, 16)),
    (20, (1, 2, 4, 8, 16, 20)), (64, (1, 2, 4, 8, 16, 32, 48, 64)),
])
def test_graph_sizes(max_num_seqs: int, sizes: tuple[int, ...]) -> None:
    assert graph_sizes(max_num_seqs) == sizes


def test_graph_sizes_refuse_an_empty_range() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        graph_sizes(0)


def test_padded_size_is_the_smallest_size_that_fits() -> None:
    sizes = graph_sizes(40)  # 1, 2, 4, 8, 16, 32, 40
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 32, 40, 40]
    assert padded_size(0, sizes) is None
    assert padded_size(41, sizes) is None


class PlainBackend(AttentionBackend):
    """Keeps the base hooks: cannot be captured."""

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, scale):  # noqa: ANN001, ANN202
        return q


def test_graphs_unavailable_reasons_in_order() -> None:
    torch_ref = TorchReferenceBackend()
    assert torch_ref.supports_cuda_graphs is True
    assert "--no-cuda-graphs" in graphs_unavailable_reason(False, "cuda", torch_ref)
    assert graphs_unavailable_reason(True, "cpu", torch_ref) == "device cpu is not CUDA"
    assert "PlainBackend cannot be captured" in graphs_unavailable_reason(True, "cuda:0", PlainBackend())
    if CUDA:
        assert graphs_unavailable_reason(True, "cuda", torch_ref) == ""
    else:
        assert graphs_unavailable_reason(True, "cuda", torch_ref) == "CUDA is not available on this machine"


def make_step(seqs: list[tuple[int, list[int]]], first_seq: int = 0, logits: bool = True,
              **extra: object) -> ModelInput:
    """A step computing ``new`` tokens after ``context`` cached ones of each ``(context, new)``
    sequence; sequence ``first_seq + i`` owns blocks ``(first_seq + i) * 8 ..``."""
    ids, positions, slots, tables, starts, lens = [], [], [], [], [0], []
    width = max(-(-(c + len(new)) // BLOCK) for c, new in seqs)
    for i, (context, new) in enumerate(seqs):
        blocks = [(first_seq + i) * BLOCKS_PER_SEQ + b for b in range(BLOCKS_PER_SEQ)]
        for j, token in enumerate(new):
            pos = context + j
            ids.append(token)
            positions.append(pos)
            slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        num = -(-(context + len(new)) // BLOCK)
        tables.append(blocks[:num] + [0] * (width - num))
        starts.append(starts[-1] + len(new))
        lens.append(context + len(new))
    rows = [end - 1 for end in starts[1:]] if logits else []
    return ModelInput(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int64), query_start_loc=starts, seq_lens=lens,
        num_logit_rows=[1 if logits else 0] * len(seqs), logit_row_indices=torch.tensor(rows, dtype=torch.int64),
        block_copies=[], **extra)


def test_which_steps_may_replay() -> None:
    decode = make_step([(5, [7]), (9, [8]), (2, [3])])
    assert step_ineligible_reason(decode, 4, 16) == ""
    assert "not decode-only" in step_ineligible_reason(make_step([(0, [1, 2, 3])]), 4, 16)
    assert "not decode-only" in step_ineligible_reason(make_step([(5, [7]), (0, [1, 2])]), 4, 16)
    assert "exceed the largest captured batch (2)" in step_ineligible_reason(decode, 2, 16)
    assert "block tables 3 wide" in step_ineligible_reason(decode, 4, 2)
    assert step_ineligible_reason(make_step([(5, [7])], logits=False), 1, 16) == ""  # no logits: still a decode
    base = make_step([(5, [7]), (9, [8])], adapter_slots=torch.tensor([-1, -1]))
    assert step_ineligible_reason(base, 4, 16) == ""  # every token on the base model: no LoraBatch
    lora = make_step([(5, [7]), (9, [8])], adapter_slots=torch.tensor([-1, 0]))
    assert "LoRA" in step_ineligible_reason(lora, 4, 16)
    media = make_step([(5, [7])], input_embeds=(torch.tensor([0]), torch.zeros(1, 8)))
    assert "media" in step_ineligible_reason(media, 4, 16)
    empty = ModelInput(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                       torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0, dtype=torch.int64), [0], [], [],
                       torch.zeros(0, dtype=torch.int64), [])
    assert step_ineligible_reason(empty, 4, 16) == "empty step"


def test_padded_decode_buffers() -> None:
    step = make_step([(5, [7]), (9, [8]), (2, [3])])
    padded = padded_decode(step, 4, 6, BLOCK, SCRATCH)
    assert padded.input_ids.tolist() == [7, 8, 3, 0]
    assert padded.positions.tolist() == [5, 9, 2, 0]
    assert padded.meta.slot_mapping.tolist() == [*step.slot_mapping.tolist(), SCRATCH * BLOCK]
    assert padded.meta.seq_lens == [6, 10, 3, 1]
    assert padded.meta.query_start_loc == [0, 1, 2, 3, 4]
    # As wide as the step's own table, not the graphs' 6 columns (the buffers zero the rest): a
    # replay built and copied a max_model_len-wide table every step (found by review).
    assert padded.meta.block_tables.shape == (4, step.block_tables.shape[1]) == (4, 3)
    assert padded.meta.block_tables[:3].tolist() == step.block_tables.tolist()
    assert padded.meta.block_tables[3].tolist() == [SCRATCH, 0, 0]  # a padding row: the scratch block, at length 1
    with pytest.raises(AssertionError, match="outgrows"):
        padded_decode(step, 4, 2, BLOCK, SCRATCH)
    placeholder = padded_decode(None, 2, 6, BLOCK, SCRATCH)  # capture: padding rows only
    assert placeholder.input_ids.tolist() == [0, 0] and placeholder.meta.seq_lens == [1, 1]
    assert placeholder.meta.slot_mapping.tolist() == [SCRATCH * BLOCK] * 2


def test_kernel_config_validates_cuda_graphs() -> None:
    assert KernelConfig().cuda_graphs is True
    with pytest.raises(ValueError, match=r"KernelConfig\.cuda_graphs must be True or False"):
        KernelConfig(cuda_graphs=1)


# ----------------------------------------------------------------------------- CPU runs never capture


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_cpu_runner_never_builds_graphs(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU run touched CUDA graphs")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    model_config, weights = tiny
    runner = make_runner(parse("--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK),
                               "--attention-backend", "torch"), model_config, weights, MAX_LEN)
    assert runner.graphs is None and runner.graphs_unavailable == "device cpu is not CUDA"
    assert all(k.shape[0] == NUM_BLOCKS and v.shape[0] == NUM_BLOCKS for k, v in runner.kv_caches)  # no scratch
    runner.execute(make_step([(0, [5, 6, 7])]))
    assert runner.execute(make_step([(3, [8])])).shape == (1, model_config.vocab_size)


def test_no_cuda_graphs_flag_reaches_the_runner(tiny) -> None:
    model_config, weights = tiny
    config = parse("--no-cuda-graphs", "--num-kv-blocks", str(NUM_BLOCKS), "--device", "cuda")
    assert config.kernels.cuda_graphs is False
    assert parse().kernels.cuda_graphs is True
    # The reason is decided before any tensor is made: no CUDA device is needed to see it.
    assert "--no-cuda-graphs" in graphs_unavailable_reason(config.kernels.cuda_graphs, config.device,
                                                           TorchReferenceBackend())
    cpu = make_runner(parse("--no-cuda-graphs", "--num-kv-blocks", str(NUM_BLOCKS)), model_config, weights, MAX_LEN)
    assert cpu.graphs is None and "--no-cuda-graphs" in cpu.graphs_unavailable


# ----------------------------------------------------------------------------- replay, eagerly on the CPU


class EagerRecorder:
    """The CUDA graph recorder's stand-in: "capture" runs the forward once, "replay" reruns
    it over the same buffers into the same output tensor (what a graph replay does)."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.captures += 1
        output = forward()

        def replay() -> None:
            output.copy_(forward())
        return replay, output


def cpu_runner(tiny) -> ModelRunner:
    model_config, weights = tiny
    return ModelRunner(model_config, weights, CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS), MAX_LEN,
                       attention=TorchReferenceBackend(), kernels=KernelConfig(native_cpu_kernels=False))


def attach_eager_graphs(runner: ModelRunner, max_num_seqs: int = 8) -> DecodeGraphs:
    """Give a CPU runner graphs recorded eagerly, the torch reference's buffers on the CPU."""
    attention = runner.attention
    assert isinstance(attention, TorchReferenceBackend)
    attention.init_cuda_graph_state = functools.partial(attention.init_cuda_graph_state, device="cpu")
    runner.graphs = DecodeGraphs(runner.model, attention, runner.kv_caches, device="cpu", max_num_seqs=max_num_seqs,
                                 max_num_blocks_per_seq=MAX_LEN // BLOCK, block_size=BLOCK, scratch_block=SCRATCH,
                                 recorder=EagerRecorder())
    return runner.graphs


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> None:
    runner.execute(make_step([(0, p) for p in prompts]))


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for pair in runner.kv_caches for t in pair]


def restore(runner: ModelRunner, saved: list[torch.Tensor]) -> None:
    for t, s in zip([t for pair in runner.kv_caches for t in pair], saved, strict=True):
        t.copy_(s)


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_replay_matches_the_eager_step(tiny, batch: int) -> None:
    """Padded to 1, 4, 8, 8 rows: the real rows' logits and the cache they write match the
    eager step; padding writes only the scratch block."""
    runner = cpu_runner(tiny)
    prompts = [[3 + (7 * i + j) % 100 for j in range(2 + 3 * i)] for i in range(batch)]
    prefill(runner, prompts)
    step = make_step([(len(p), [10 + i]) for i, p in enumerate(prompts)])
    before = snapshot(runner)
    eager = runner.execute(step)
    eager_cache = snapshot(runner)
    restore(runner, before)
    graphs = attach_eager_graphs(runner)
    replayed = runner.execute(step)
    assert graphs.num_replays == 1 and graphs.recorder.captures == len(graphs.sizes) == 4
    assert torch.allclose(replayed, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    for got, want in zip(snapshot(runner), eager_cache, strict=True):
        assert torch.allclose(got[:SCRATCH], want[:SCRATCH], atol=1e-6)  # the scratch block is the only difference


def test_the_backend_can_send_a_decode_step_to_the_eager_path(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step that fits a graph still runs eagerly when the backend says it would launch
    it differently (Triton's split-KV for long contexts: ``graph_step_ineligible_reason``)."""
    runner = cpu_runner(tiny)
    graphs = attach_eager_graphs(runner)
    monkeypatch.setattr(runner.attention, "graph_step_ineligible_reason",
                        lambda seq_lens, block_size: "too long" if max(seq_lens) > 5 else "")
    prefill(runner, [[5, 6, 7], [8, 9, 10, 11, 12, 13]])
    assert graphs.ineligible_reason(make_step([(3, [20])])) == ""
    long_step = make_step([(3, [20]), (6, [21])])
    assert graphs.ineligible_reason(long_step) == "too long"
    runner.execute(long_step)
    assert graphs.num_replays == 0


def mixed_steps() -> list[ModelInput]:
    """Prefills, decode steps of 2, 4, 3 (padded to 4) and 1 sequences, and a chunk beside a
    decode, in an order a server could run them: 4 of the 7 steps are decode-only."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    return [
        make_step([(0, p) for p in prompts[:2]]),  # prefill: eager
        make_step([(3, [20]), (2, [21])]),  # decode of 2
        make_step([(0, prompts[2]), (0, prompts[3])], first_seq=2),  # prefill: eager
        make_step([(4, [22]), (3, [23]), (4, [24]), (1, [25])]),  # decode of 4
        make_step([(5, [26]), (4, [27]), (5, [28])]),  # decode of 3: padded to 4
        make_step([(6, [29]), (5, [30, 31])]),  # a chunk of 2 beside a decode: eager
        make_step([(7, [32])]),  # decode of 1
    ]


def test_runner_replays_decodes_and_runs_the_rest_eagerly(tiny) -> None:
    """Prefill steps, LoRA-free decode steps of several sizes in turn, and a mixed step: the
    graphs serve exactly the decode-only steps, each as the eager run would."""
    reference, runner = cpu_runner(tiny), cpu_runner(tiny)
    graphs = attach_eager_graphs(runner, max_num_seqs=4)
    for i, step in enumerate(mixed_steps()):
        want, got = reference.execute(step), runner.execute(step)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"step {i}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {i}"
    assert graphs.num_replays == 4


def test_graph_mode_reads_only_the_buffers(tiny) -> None:
    """After ``prepare_for_capture`` the torch reference ignores the last eager step's plan:
    its forward reads the buffers ``prepare_for_replay`` filled."""
    backend = TorchReferenceBackend()
    backend.init_cuda_graph_state(4, 3, device="cpu")
    k_cache = torch.randn(8, BLOCK, 2, 16)
    v_cache = torch.randn(8, BLOCK, 2, 16)
    stale = AttentionMetadata([0, 1], [9], torch.tensor([[5, 6, 7]]), torch.tensor([30]), BLOCK)
    backend.prepare(stale)
    backend.prepare_for_capture(2)
    meta = AttentionMetadata([0, 1, 2], [6, 1], torch.tensor([[1, 2], [4, 4]]), torch.tensor([9, 16]), BLOCK)
    backend.prepare_for_replay(meta)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    graph_out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), 0.25)
    backend.prepare(meta)  # the same step, eagerly
    assert torch.allclose(graph_out, backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), 0.25), atol=1e-6)


# ----------------------------------------------------------------------------- on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 9])
def test_cuda_graph_greedy_tokens_match_eager(tiny, batch: int) -> None:
    """Greedy decoding on CUDA, with and without graphs (batches padded to 1, 2, 4, 8, 8, 16):
    the same tokens, bit for bit; logits within float32 noise."""
    model_config, weights = tiny
    runs = []
    for graphs in (False, True):
        runner = ModelRunner(model_config, weights, CacheConfig(block_size=BLOCK, num_blocks=2 * NUM_BLOCKS),
                             MAX_LEN, device="cuda", attention=TorchReferenceBackend(),
                             kernels=KernelConfig(cuda_graphs=graphs), max_num_seqs=16)
        assert (runner.graphs is not None) == graphs
        prompts = [[3 + (5 * i + j) % 100 for j in range(1 + 2 * i % 9)] for i in range(batch)]
        logits = runner.execute(make_step([(0, p) for p in prompts]))
        tokens, all_logits, lens = [logits.argmax(-1).tolist()], [logits], [len(p) for p in prompts]
        for _ in range(12):
            logits = runner.execute(make_step([(n, [t]) for n, t in zip(lens, tokens[-1], strict=True)]))
            lens = [n + 1 for n in lens]
            tokens.append(logits.argmax(-1).tolist())
            all_logits.append(logits)
        if graphs:  # every step of one new token per sequence replays: the first too when prompts are 1 token
            assert runner.graphs.num_replays == 12 + all(len(p) == 1 for p in prompts)
        runs.append((tokens, all_logits))
    assert runs[0][0] == runs[1][0]
    for eager, graphed in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.allclose(eager, graphed, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_engine_greedy_tokens_with_and_without_cuda_graphs(tiny) -> None:
    from refengine.engine.engine import Engine
    from refengine.types import GenerationRequest, SamplingParams, StoppingParams
    from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    model = make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=128)
    model_config, weights = model_config_from_hf(model), hf_weights(model)
    prompts = [[3 + (11 * i + j) % (len(tokenizer) - 3) for j in range(3 + 4 * i)] for i in range(5)]
    outputs = []
    for graphs in (False, True):
        engine = Engine(EngineConfig(device="cuda", attention_backend="torch", max_model_len=128,
                                     max_sequences_per_request=8, kernels=KernelConfig(cuda_graphs=graphs),
                                     cache=CacheConfig(block_size=BLOCK, num_blocks=128),
                                     scheduler=SchedulerConfig(max_num_seqs=8)),
                        model_config, weights, tokenizer, model_fingerprint="tiny")
        requests = [GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=0.0),
                                      stopping=StoppingParams(max_tokens=24, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        outputs.append([r.outputs[0].token_ids for r in engine.run_until_done(requests)])
        graph_runs = engine.core.runner.graphs
        assert (graph_runs is not None and graph_runs.num_replays > 0) == graphs
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_backends_without_capture_run_eagerly_on_cuda(tiny) -> None:
    model_config, weights = tiny
    runner = ModelRunner(model_config, weights, CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS), MAX_LEN,
                         device="cuda", attention=PlainBackend())
    assert runner.graphs is None and "cannot be captured" in runner.graphs_unavailable
    assert all(k.shape[0] == NUM_BLOCKS for k, _ in runner.kv_caches)
