"""Multi-LoRA in the engine, on a tiny random Llama: PEFT is the oracle (R1–R7, E4).

Adapters are made by peft itself (``get_peft_model`` + ``save_pretrained``, random A and B),
so the engine reads exactly what PEFT writes and must compute what PEFT computes.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftConfig
from peft import get_peft_model
from safetensors.torch import load_file, save_file

from refengine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import (
    BlockStored,
    GenerationRequest,
    InvalidRequestError,
    KvEvent,
    LogprobParams,
    LoraAdapterSpec,
    LoraConflictError,
    LoraDisabledError,
    LoraNotFoundError,
    OverloadedError,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: name -> (rank, target modules, rsLoRA, seed)
ADAPTERS = {"attn4": (4, ["q_proj", "v_proj"], False, 1), "all8": (8, ALL, False, 2),
            "mlp8rs": (8, ["gate_proj", "up_proj", "down_proj"], True, 3), "ko16": (16, ["k_proj", "o_proj"], True, 4)}
PROMPTS = [[5 + (7 * i + 3 * j) % 200 for j in range(9 + 3 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=len(TOKENIZER), max_position_embeddings=256)
    return model, model_config_from_hf(model), hf_weights(model)


def make_adapter(model: torch.nn.Module, directory: Path, rank: int, modules: list[str], rslora: bool = False,
                 seed: int = 0, **options) -> torch.nn.Module:
    """A random PEFT adapter saved in ``directory``; returns the PEFT model (the oracle)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), PeftConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules, use_rslora=rslora, init_lora_weights=False, **options))
    peft_model.save_pretrained(str(directory))
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """The root directory and, per adapter name, its directory and PEFT model."""
    root = tmp_path_factory.mktemp("loras")
    made = {name: (root / name, make_adapter(tiny[0], root / name, rank, modules, rslora, seed))
            for name, (rank, modules, rslora, seed) in ADAPTERS.items()}
    return root, made


def make_engine(tiny, root: Path, max_loras: int = 4, enabled: bool = True, sink=None, **lora) -> Engine:
    _, config, weights = tiny
    return Engine(EngineConfig(max_model_len=256, cache=CacheConfig(block_size=4, num_blocks=256),
                               scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
                               lora=LoraConfig(enabled=enabled, roots=(str(root),), max_loras=max_loras, **lora)),
                  config, weights, TOKENIZER, model_fingerprint="tiny", kv_event_sink=sink)


def spec(name: str, root: Path, lora_id: int | None = None) -> LoraAdapterSpec:
    return LoraAdapterSpec(lora_id or sorted(ADAPTERS).index(name) + 1, name, str(root / name))


def greedy(rid: str, ids: list[int], lora: str | None = None, n: int = 8) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=n, ignore_eos=True), lora_name=lora)


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int = 8) -> list[int]:
    out, seq = [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            token = int(model(seq).logits[0, -1].argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out


def tokens(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    return [c.outputs[0].token_ids for c in engine.run_until_done(requests)]


def assert_idle(engine: Engine) -> None:
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0, "KV blocks leaked"


@pytest.fixture(scope="module")
def loaded(tiny, adapters):
    root, _ = adapters
    engine = make_engine(tiny, root)
    for name in ADAPTERS:
        assert engine.load_lora(spec(name, root)) == (spec(name, root), False)
    return engine


def test_each_adapter_matches_peft_and_changes_the_output(tiny, adapters, loaded) -> None:
    _, made = adapters
    base = hf_greedy(tiny[0], PROMPTS[0])
    for name, (_, peft_model) in made.items():
        expected = hf_greedy(peft_model, PROMPTS[0])
        assert tokens(loaded, [greedy(name, PROMPTS[0], name)]) == [expected], name
        assert expected != base, f"{name} does not change the output: the test would prove nothing"
    assert_idle(loaded)


def test_logits_match_peft(tiny, adapters) -> None:
    """The runner's logits for every prompt position, with the adapter in a slot, vs PEFT's."""
    root, made = adapters
    engine = make_engine(tiny, root, max_loras=1)
    from refengine.engine.input_builder import build_model_input
    from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput
    ids = PROMPTS[3]
    num_blocks = -(-len(ids) // 4)
    sched = SchedulerOutput([ScheduledSequence("r", 0, 0, len(ids), True, tuple(ids), tuple(range(num_blocks)))])
    for name in ADAPTERS:
        loaded = engine.loras.load(spec(name, root))[0]
        engine.core.runner.set_lora_slot(0, loaded.adapter.layers)
        model_input = build_model_input(sched, 4, [len(ids)], [0])
        logits = engine.core.runner.execute(model_input)
        with torch.no_grad():
            expected = made[name][1](torch.tensor([ids])).logits[0].float()
        assert torch.allclose(logits, expected, atol=1e-4), (name, (logits - expected).abs().max())


@pytest.mark.parametrize("max_loras", [4, 2, 1])
def test_a_mixed_batch_gives_each_request_its_solo_tokens(tiny, adapters, max_loras: int) -> None:
    root, _ = adapters
    names = [None, *ADAPTERS]
    requests = [greedy(f"r{i}", PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(10)]
    solo_engine = make_engine(tiny, root)
    for name in ADAPTERS:
        solo_engine.load_lora(spec(name, root))
    solo = [tokens(solo_engine, [r])[0] for r in requests]
    engine = make_engine(tiny, root, max_loras=max_loras)
    for name in ADAPTERS:
        engine.load_lora(spec(name, root))
    per_step: list[set[int]] = []  # distinct adapters of each step
    assign = engine.core.lora.slots.assign

    def counting_assign(step_adapters):
        step_adapters = list(step_adapters)
        per_step.append({loaded.key for loaded in step_adapters})
        return assign(step_adapters)

    engine.core.lora.slots.assign = counting_assign
    assert tokens(engine, requests) == solo
    assert max(map(len, per_step)) <= max_loras
    # More adapters than slots ran: some were copied into a slot another had held.
    assert max_loras == 4 or len(set().union(*per_step)) > max_loras
    assert_idle(engine)


def test_prefix_cache_is_per_adapter_and_shared_by_the_same_files(tiny, adapters) -> None:
    root, made = adapters
    events: list[KvEvent] = []
    engine = make_engine(tiny, root, sink=events.extend)
    engine.load_lora(spec("all8", root))
    ids = PROMPTS[4]
    runs = {}
    for rid, lora in (("base", None), ("a", "all8"), ("a-again", "all8"), ("base-again", None)):
        runs[rid] = engine.run_until_done([greedy(rid, ids, lora)])[0]
    assert runs["a"].usage.cached_prompt_tokens == 0  # the base model's blocks are not the adapter's
    assert runs["a-again"].usage.cached_prompt_tokens > 0 and runs["base-again"].usage.cached_prompt_tokens > 0
    assert runs["a-again"].outputs[0].token_ids == hf_greedy(made["all8"][1], ids)
    # the same files under another id and name share the cache (the key is the files' digest)
    engine.load_lora(_copy_adapter(root, "all8", "copy", 99))
    again = engine.run_until_done([greedy("copy", ids, "copy")])[0]
    assert again.usage.cached_prompt_tokens > 0
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.lora for e in stored} == {None, spec("all8", root)}  # E4: the adapter travels with its blocks
    assert all(any(k.startswith("lora:") for k in e.extra_keys) == (e.lora is not None) for e in stored)
    assert_idle(engine)


def _copy_adapter(root: Path, name: str, copy_name: str, lora_id: int) -> LoraAdapterSpec:
    """The files of adapter ``name`` again, under another directory, name and id."""
    (root / copy_name).mkdir(exist_ok=True)
    for file in (root / name).iterdir():
        (root / copy_name / file.name).write_bytes(file.read_bytes())
    return LoraAdapterSpec(lora_id, copy_name, str(root / copy_name))


def test_lifecycle_rules(tiny, adapters) -> None:
    root, _ = adapters
    engine = make_engine(tiny, root, max_loaded_loras=4, max_loras=2)
    a = spec("attn4", root)
    for bad, message in ((LoraAdapterSpec(0, "x", a.source_path), "lora_id must be > 0"),
                         (LoraAdapterSpec(-3, "x", a.source_path), "lora_id must be > 0"),
                         (LoraAdapterSpec(7, "", a.source_path), "lora_name must be a non-empty"),
                         (LoraAdapterSpec(7, "x", "attn4"), "absolute directory"),
                         (LoraAdapterSpec(7, "x", str(root / "missing")), "not a directory"),
                         (LoraAdapterSpec(7, "x", a.source_path + "\0x"), "NUL character")):
        with pytest.raises(InvalidRequestError, match=message):  # R1
            engine.load_lora(bad)
    assert engine.list_loras() == []
    assert engine.load_lora(a) == (a, False)
    assert engine.load_lora(a) == (a, True)  # R2
    for conflicting in (LoraAdapterSpec(a.lora_id, "other", spec("all8", root).source_path),  # same id
                        LoraAdapterSpec(50, a.lora_name, spec("all8", root).source_path),  # same name
                        LoraAdapterSpec(51, "other", a.source_path),  # same path
                        LoraAdapterSpec(52, "other", a.source_path + "/")):  # the same path spelled otherwise
        with pytest.raises(LoraConflictError):  # R3
            engine.load_lora(conflicting)
    assert engine.list_loras() == [a]
    with pytest.raises(LoraNotFoundError):  # R4
        engine.unload_lora("nope")
    with pytest.raises(LoraNotFoundError):
        engine.add_request(greedy("x", PROMPTS[0], "nope"))
    for name in ("all8", "mlp8rs", "ko16"):
        engine.load_lora(spec(name, root))
    with pytest.raises(OverloadedError, match="unload one first"):
        engine.load_lora(_copy_adapter(root, "attn4", "fifth", 98))
    assert engine.unload_lora("attn4") == a
    assert [s.lora_name for s in engine.list_loras()] == ["all8", "ko16", "mlp8rs"]
    disabled = make_engine(tiny, root, enabled=False)
    for call in (lambda: disabled.load_lora(a), lambda: disabled.unload_lora("attn4"), disabled.list_loras):
        with pytest.raises(LoraDisabledError):  # R5
            call()
    with pytest.raises(LoraNotFoundError):
        disabled.add_request(greedy("y", PROMPTS[0], "attn4"))
    assert disabled.info.max_loras == 0 and engine.info.max_loras == 2


def test_paths_must_stay_inside_a_root(tiny, adapters, tmp_path) -> None:
    root, _ = adapters
    outside = tmp_path / "outside"
    outside.mkdir()
    for file in (root / "attn4").iterdir():
        (outside / file.name).write_bytes(file.read_bytes())
    engine = make_engine(tiny, root)
    escape_link = root / "escape-link"
    if not escape_link.exists():
        escape_link.symlink_to(outside, target_is_directory=True)
    sneaky = root / "sneaky-file"
    if not sneaky.exists():
        sneaky.mkdir()
        (sneaky / "adapter_config.json").write_bytes((root / "attn4" / "adapter_config.json").read_bytes())
        (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for path, message in ((str(outside), "not inside an allowed LoRA root"),
                          (f"{root}/../{outside.parent.name}/{outside.parent.name}/outside", "not inside"),
                          (f"{root}/attn4/../../outside", "not inside"),
                          (str(escape_link), "not inside an allowed LoRA root"),
                          (str(sneaky), "leads outside the allowed LoRA roots")):
        with pytest.raises(InvalidRequestError, match=message):
            engine.load_lora(LoraAdapterSpec(40, "escape", path))
    assert engine.list_loras() == []


def _broken(root: Path, name: str, config_change: dict | None = None, tensors=None) -> Path:
    """A copy of ``attn4`` with its config or tensors changed."""
    target = root / name
    target.mkdir(exist_ok=True)
    config = json.loads((root / "attn4" / "adapter_config.json").read_text()) | (config_change or {})
    (target / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(root / "attn4" / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(target / "adapter_model.safetensors"))
    return target


def _first_a(weights: dict) -> str:
    return next(k for k in sorted(weights) if "lora_A" in k)


BROKEN = {
    "dora": (dict(use_dora=True), None, "use_dora=True is not supported"),
    "bias": (dict(bias="all"), None, "bias='all' is not supported"),
    "modules-to-save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "not-lora": (dict(peft_type="IA3"), None, "peft_type 'IA3' is not supported"),
    "rank-says-other": (dict(r=8), None, "rank 4 but adapter_config.json says r=8"),
    "shape": (None, lambda w: w | {_first_a(w): torch.zeros(4, 7)}, "do not fit the model's projection"),
    "embedding": (None, lambda w: w | {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 9)},
                  "not a LoRA A/B weight"),
    "half-pair": (None, lambda w: {k: v for k, v in w.items() if k != _first_a(w)}, "but not both lora_A and lora_B"),
    "empty": (None, lambda w: {}, "holds no LoRA weights"),
    "alora": (dict(alora_invocation_tokens=[60, 61]), None, "alora_invocation_tokens=.60, 61. is not supported"),
    # inits that rewrite the base weights, saved unconverted (PEFT redoes the rewrite on load)
    "pissa": (dict(init_lora_weights="pissa"), None, "init_lora_weights='pissa' is not supported"),
    "pissa-niter": (dict(init_lora_weights="pissa_niter_4"), None, "init_lora_weights='pissa_niter_4' is not"),
    "olora": (dict(init_lora_weights="olora"), None, "init_lora_weights='olora' is not supported"),
    "corda": (dict(init_lora_weights="corda"), None, "init_lora_weights='corda' is not supported"),
    "loftq": (dict(init_lora_weights="loftq"), None, "init_lora_weights='loftq' is not supported"),
    "alpha-nan": (dict(lora_alpha=float("nan")), None, "lora_alpha must be a finite number > 0, got nan"),
    "alpha-inf": (dict(lora_alpha=float("inf")), None, "lora_alpha must be a finite number > 0, got inf"),
    "alpha-pattern-string": (dict(alpha_pattern={"q_proj": "16"}), None,
                             "alpha_pattern.'q_proj'. must be a finite number > 0, got '16'"),
    "rank-pattern-zero": (dict(rank_pattern={"q_proj": 0}), None, "rank_pattern.'q_proj'. must be a finite number"),
    "pattern-not-regex": (dict(rank_pattern={"q_proj(": 4}), None, "key 'q_proj.' is not a regular expression"),
    "weights-nan": (None, lambda w: w | {_first_a(w): w[_first_a(w)] * float("nan")}, "holds NaN or infinity"),
    # float8 has no isfinite on CPU: it was INTERNAL (NotImplementedError)
    "weights-float8": (None, lambda w: w | {_first_a(w): w[_first_a(w)].to(torch.float8_e4m3fn)},
                       "must be float16, bfloat16, float32 or float64"),
    "scale-overflows": (dict(lora_alpha=1e300), None, "times its scale 2.5e.299, holds NaN or infinity"),
    "untargeted": (dict(target_modules=["q_proj"]), None, "v_proj: adapter_model.safetensors holds its weights, "
                   "but {'target_modules': .'q_proj'.} does not target it"),
    # PEFT narrows a target_modules list to layers_to_transform and drops exclude_modules: it
    # would ignore the other weights, so applying them would not be PEFT's model.
    "outside-layers": (dict(layers_to_transform=[0]), None, "layers.1.self_attn.q_proj: .* 'layers_to_transform': .0."),
    "outside-layer-int": (dict(layers_to_transform=1), None, "layers.0.self_attn.q_proj: .* does not target it"),
    "excluded": (dict(exclude_modules=["v_proj"]), None, "layers.0.self_attn.v_proj: .* 'exclude_modules'"),
    "excluded-regex": (dict(exclude_modules=r".*\.0\.self_attn\.q_proj"), None, "layers.0.self_attn.q_proj: .*"),
    "attention-under-mlp": (None, lambda w: {k.replace("self_attn.q_proj", "mlp.q_proj"): v for k, v in w.items()},
                            "not a LoRA A/B weight"),
    "same-weight-twice": (None, lambda w: w | {_first_a(w).removeprefix("base_model.model."): w[_first_a(w)].clone()},
                          "another key names the same weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_adapters_are_refused_and_nothing_is_loaded(tiny, adapters, case: str) -> None:
    root, _ = adapters
    config_change, tensors, message = BROKEN[case]
    path = _broken(root, f"broken-{case}", config_change, tensors)
    engine = make_engine(tiny, root)
    with pytest.raises(InvalidRequestError, match=message):
        engine.load_lora(LoraAdapterSpec(30, case, str(path)))
    assert engine.list_loras() == []


def test_rank_limit_pickle_and_garbage_files_are_refused(tiny, adapters) -> None:
    root, _ = adapters
    engine = make_engine(tiny, root, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="rank 16 is above this server's --max-lora-rank 8"):
        engine.load_lora(spec("ko16", root))
    pickled = root / "pickled"
    pickled.mkdir(exist_ok=True)
    (pickled / "adapter_config.json").write_bytes((root / "attn4" / "adapter_config.json").read_bytes())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(InvalidRequestError, match="pickle, which is never loaded"):
        engine.load_lora(LoraAdapterSpec(31, "pickled", str(pickled)))
    garbage = _broken(root, "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        engine.load_lora(LoraAdapterSpec(32, "garbage", str(garbage)))
    with (garbage / "adapter_model.safetensors").open("wb") as huge:
        huge.truncate(64 << 20)  # sparse: larger than any rank-8 adapter of this model
    with pytest.raises(InvalidRequestError, match="larger .* than any adapter of rank <= 8"):
        engine.load_lora(LoraAdapterSpec(32, "garbage", str(garbage)))
    (garbage / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        engine.load_lora(LoraAdapterSpec(32, "garbage", str(garbage)))
    (garbage / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000)  # RecursionError: was INTERNAL
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        engine.load_lora(LoraAdapterSpec(32, "garbage", str(garbage)))
    assert engine.list_loras() == []


@pytest.mark.timeout(60)
def test_adapter_patterns_are_matched_with_a_time_limit(tiny, adapters, monkeypatch) -> None:
    """rank_pattern, alpha_pattern and a target_modules string are regular expressions from the
    adapter's files. Python's re backtracked for ever on ``(.*)*(.*)*...x`` while holding the GIL
    (one LoadLora froze the server); they run in the regex module under a time limit, refused past it."""
    from refengine.lora import peft

    root, _ = adapters
    backtracking = "(.*)*(.*)*(.*)*(.*)*(.*)*(.*)*(.*)*x"
    engine = make_engine(tiny, root)
    path = _broken(root, "backtracking", dict(rank_pattern={backtracking: 4}, alpha_pattern={backtracking: 8}))
    engine.load_lora(LoraAdapterSpec(33, "backtracking", str(path)))  # matches nothing, at once: r and lora_alpha
    assert [a.lora_name for a in engine.list_loras()] == ["backtracking"]
    monkeypatch.setattr(peft, "PATTERN_SECONDS", 1e-9)
    slow = _broken(root, "slow-pattern", dict(target_modules=".*_proj"))
    with pytest.raises(InvalidRequestError, match=r"the pattern '\.\*_proj' took over 1e-09 s to match"):
        engine.load_lora(LoraAdapterSpec(34, "slow", str(slow)))
    assert [a.lora_name for a in engine.list_loras()] == ["backtracking"]


def test_per_module_ranks_and_alphas_match_peft(tiny, adapters) -> None:
    root, _ = adapters
    peft_model = make_adapter(tiny[0], root / "patterned", 4, ALL, seed=9,
                              rank_pattern={"v_proj": 8, "down_proj": 2}, alpha_pattern={"q_proj": 3.0})
    engine = make_engine(tiny, root)
    engine.load_lora(LoraAdapterSpec(60, "patterned", str(root / "patterned")))
    assert tokens(engine, [greedy("p", PROMPTS[2], "patterned")]) == [hf_greedy(peft_model, PROMPTS[2])]


def test_unloading_lets_accepted_requests_finish_on_the_adapter(tiny, adapters) -> None:
    root, made = adapters
    engine = make_engine(tiny, root, max_loras=1)
    engine.load_lora(spec("all8", root))
    engine.load_lora(spec("attn4", root))
    streams = [engine.add_request(greedy(f"u{i}", PROMPTS[i], "all8" if i % 2 else "attn4")) for i in range(4)]
    engine.step()  # some run, the rest wait (one slot)
    engine.unload_lora("all8")
    with pytest.raises(LoraNotFoundError):
        engine.add_request(greedy("late", PROMPTS[0], "all8"))
    while engine.has_unfinished_requests:
        engine.step()
    for i, stream in enumerate(streams):
        name = "all8" if i % 2 else "attn4"
        assert stream.result().outputs[0].token_ids == hf_greedy(made[name][1], PROMPTS[i])
    assert_idle(engine)


def test_concurrent_load_unload_and_generate(tiny, adapters) -> None:
    root, made = adapters
    engine = make_engine(tiny, root, max_loras=2)
    engine.load_lora(spec("all8", root))
    expected = hf_greedy(made["all8"][1], PROMPTS[1])
    engine.start()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(5):
                for name in ("attn4", "mlp8rs"):
                    engine.load_lora(spec(name, root))
                for name in ("attn4", "mlp8rs"):
                    engine.unload_lora(name)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def generate(worker: int) -> None:
        try:
            for j in range(3):
                stream = engine.add_request(greedy(f"g{worker}-{j}", PROMPTS[1], "all8"))
                assert stream.result().outputs[0].token_ids == expected
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn)] + [threading.Thread(target=generate, args=(w,)) for w in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        engine.shutdown()
    assert not errors, errors
    assert [s.lora_name for s in engine.list_loras()] == ["all8"]
    assert_idle(engine)


def test_no_adapter_weights_without_lora(tiny, adapters) -> None:
    """LoRA off: the projections are plain (no slot buffers, no per-step cost)."""
    root, _ = adapters
    engine = make_engine(tiny, root, enabled=False)
    assert engine.core.lora is None
    assert all(not layer.lora_projections() for layer in engine.core.runner.model.layers)


def test_non_finite_logits_fail_their_request_alone(tiny, adapters) -> None:
    """An adapter that loads (finite alpha 1e30) but overflows the activations gives NaN logits:
    each of its requests -- sampled or greedy, with or without logprobs -- ends with one INTERNAL
    fault naming them; a base request (with logprobs) in the same steps keeps its solo tokens,
    and every KV block comes back (no step-wide failure). Before, the greedy one got token 0
    with a NaN logprob and a sampled one with logprobs failed the whole step."""
    root, _ = adapters
    path = _broken(root, "overflows", dict(lora_alpha=1e30))
    engine = make_engine(tiny, root)
    engine.load_lora(LoraAdapterSpec(31, "overflows", str(path)))
    with_logprobs = LogprobParams(output_logprobs=True)
    base = replace(greedy("base", PROMPTS[1]), logprobs=with_logprobs)
    base_alone = engine.run_until_done([replace(base, request_id="alone")])[0].outputs[0]
    broken = [GenerationRequest(f"nan-{i}", prompt_token_ids=PROMPTS[1], sampling=sampling, logprobs=logprobs,
                                stopping=StoppingParams(max_tokens=8, ignore_eos=True), lora_name="overflows")
              for i, (sampling, logprobs) in enumerate([(SamplingParams(temperature=0.8, seed=1), LogprobParams()),
                                                        (SamplingParams(temperature=0.8, seed=1), with_logprobs),
                                                        (SamplingParams(temperature=0.0), with_logprobs)])]
    base_out, *failed = engine.run_until_done([base, *broken])
    assert base_out.error is None and base_out.outputs[0].token_ids == base_alone.token_ids
    assert [t.logprob for t in base_out.outputs[0].tokens] == [t.logprob for t in base_alone.tokens]
    assert all(t.logprob is not None for t in base_alone.tokens)
    for out in failed:
        assert out.error is not None and out.error.code == "internal" and "not finite" in out.error.message, out
        assert not out.outputs[0].token_ids
    assert_idle(engine)


def test_layer_and_exclude_options_peft_writes_load_and_match_peft(tiny, adapters) -> None:
    """The other side of "outside-layers" / "excluded": what PEFT itself saves with
    layers_to_transform and exclude_modules loads, and computes PEFT's model."""
    root, _ = adapters
    peft_model = make_adapter(tiny[0], root / "narrowed", 4, ALL, seed=11, layers_to_transform=[1],
                              exclude_modules=["o_proj"])
    config = json.loads((root / "narrowed" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1] and config["exclude_modules"] == ["o_proj"]
    engine = make_engine(tiny, root)
    engine.load_lora(LoraAdapterSpec(61, "narrowed", str(root / "narrowed")))
    expected = hf_greedy(peft_model, PROMPTS[2])
    assert tokens(engine, [greedy("n", PROMPTS[2], "narrowed")]) == [expected]
    assert expected != hf_greedy(tiny[0], PROMPTS[2])


def test_r2_a_retried_load_is_already_loaded_after_its_files_are_gone(tiny, adapters, tmp_path) -> None:
    """R2: the weights are in memory once loaded, so deleting the directory (a download
    cleaned up) must not turn an identical retried LoadLora into INVALID_ARGUMENT; it was,
    because the path was checked before the loaded adapters were."""
    root, made = adapters
    shutil.copytree(root / "attn4", root / "transient")
    transient = LoraAdapterSpec(62, "transient", str(root / "transient"))
    engine = make_engine(tiny, root)
    assert engine.load_lora(transient) == (transient, False)
    shutil.rmtree(root / "transient")
    assert engine.load_lora(transient) == (transient, True)
    assert tokens(engine, [greedy("t", PROMPTS[0], "transient")]) == [hf_greedy(made["attn4"][1], PROMPTS[0])]
    with pytest.raises(LoraConflictError):  # R3 still holds: its id and name on another path
        engine.load_lora(replace(transient, source_path=spec("all8", root).source_path))
    with pytest.raises(InvalidRequestError, match="not a directory"):  # R1 for anything else on that path
        engine.load_lora(LoraAdapterSpec(64, "other", transient.source_path))


def test_the_cache_key_is_the_digest_of_the_bytes_the_weights_came_from(tiny, adapters, monkeypatch) -> None:
    """E4: an adapter rewritten in place while it loads (a training job saving checkpoints)
    must get the key of the weights it computes with. The files were read twice -- once
    for the weights, again for the digest -- so the load kept the old weights under the new
    files' key, and a later load of the new files reused the old adapter's KV blocks."""
    from refengine.lora import peft

    root, _ = adapters
    _copy_adapter(root, "attn4", "rewritten", 70)
    original_key = make_engine(tiny, root).loras.load(_copy_adapter(root, "attn4", "pristine", 71))[0].cache_key
    scaled_pair = peft._scaled_pair

    def rewrite_then_scale(path: Path, *args, **kwargs):  # noqa: ANN202
        if path.name == "rewritten":  # mid-load: the weights are read, the digest (was) not yet
            (path / "adapter_model.safetensors").write_bytes((root / "all8" / "adapter_model.safetensors").read_bytes())
        return scaled_pair(path, *args, **kwargs)

    monkeypatch.setattr(peft, "_scaled_pair", rewrite_then_scale)
    loaded, _ = make_engine(tiny, root).loras.load(LoraAdapterSpec(70, "rewritten", str(root / "rewritten")))
    assert loaded.cache_key == original_key
    (root / "rewritten" / "adapter_config.json").write_bytes((root / "all8" / "adapter_config.json").read_bytes())
    now = make_engine(tiny, root).loras.load(LoraAdapterSpec(72, "now", str(root / "rewritten")))[0].cache_key
    assert now == make_engine(tiny, root).loras.load(spec("all8", root))[0].cache_key != original_key


def test_the_cache_key_tells_where_one_file_ends() -> None:
    """The key digests the config and the weights each with its length: moving a byte from the end
    of one to the start of the other changes it (the digest of their concatenation did not)."""
    from refengine.lora import peft

    config, weights = b'{"r": 8}', b"\x20\x00safetensors"
    keys = {peft._digest(config, weights), peft._digest(config + weights[:1], weights[1:]),
            peft._digest(config[:-1], config[-1:] + weights)}
    assert len(keys) == 3
    assert peft._digest(config, weights) == peft._digest(config, weights)


def test_unreadable_adapter_files_are_invalid_argument(tiny, adapters, monkeypatch) -> None:
    """R1: a directory or file the engine cannot read (permissions; gone mid-load) is "not
    visible to the engine": INVALID_ARGUMENT, not the INTERNAL an uncaught OSError became."""
    import os

    root, _ = adapters
    engine = make_engine(tiny, root)
    real_open, real_scandir = os.open, os.scandir

    def no_config(path, *args, **kwargs):  # noqa: ANN001, ANN202 - os.open's signature
        if os.path.basename(os.fspath(path)) == "adapter_config.json":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_config)
    with pytest.raises(InvalidRequestError, match="adapter_config.json cannot be read: .*Permission denied"):
        engine.load_lora(spec("attn4", root))
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "scandir", lambda path: real_scandir(str(root / "gone")))
    with pytest.raises(InvalidRequestError, match="cannot be listed: .*No such file"):
        engine.load_lora(spec("attn4", root))
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert engine.list_loras() == [] and engine.load_lora(spec("attn4", root))[1] is False


def test_e4_block_hashes_differ_per_adapter_for_the_same_tokens(tiny, adapters) -> None:
    """E4: the same prompt on the base model and on two adapters stores three disjoint sets of
    block hashes (so a KV-aware router never mixes them), each event naming its adapter."""
    root, _ = adapters
    events: list[KvEvent] = []
    engine = make_engine(tiny, root, sink=events.extend)
    for name in ("attn4", "all8"):
        engine.load_lora(spec(name, root))
    hashes: dict[str | None, set[bytes]] = {}
    for lora in (None, "attn4", "all8"):
        before = len(events)
        engine.run_until_done([greedy(f"h-{lora}", PROMPTS[4], lora, n=1)])
        stored = [e for e in events[before:] if isinstance(e, BlockStored)]
        assert stored and all(e.lora == (None if lora is None else spec(lora, root)) for e in stored)
        hashes[lora] = {e.block_hash for e in stored}
    assert len(hashes[None]) == len(hashes["attn4"]) == len(hashes["all8"])
    assert not (hashes[None] & hashes["attn4"] or hashes[None] & hashes["all8"] or hashes["attn4"] & hashes["all8"])
    assert_idle(engine)


def test_a_name_reloaded_with_other_files_while_its_requests_wait(tiny, adapters) -> None:
    """Unload, then load the same id and name from other files, while requests on the first
    load still wait for the one slot: those finish on the first load's weights, the new ones
    run on the new files, neither reuses the other's KV blocks (same prompt), and every block
    comes back."""
    root, made = adapters
    engine = make_engine(tiny, root, max_loras=1)
    engine.load_lora(LoraAdapterSpec(80, "swap", str(root / "attn4")))
    engine.load_lora(spec("mlp8rs", root))
    ids = PROMPTS[4]
    first = [engine.add_request(greedy(f"old{i}", ids, "swap" if i else "mlp8rs")) for i in range(3)]
    engine.step()  # mlp8rs holds the only slot: the two "swap" requests wait
    assert {seq.request_id for seq in engine.core.scheduler.waiting} == {"old1", "old2"}
    engine.unload_lora("swap")
    assert engine.load_lora(LoraAdapterSpec(80, "swap", str(root / "all8")))[1] is False
    second = [engine.add_request(greedy(f"new{i}", ids, "swap")) for i in range(2)]
    while engine.has_unfinished_requests:
        engine.step()
    old, new = hf_greedy(made["attn4"][1], ids), hf_greedy(made["all8"][1], ids)
    assert old != new
    assert [s.result().outputs[0].token_ids for s in first[1:]] == [old, old]
    assert [s.result().outputs[0].token_ids for s in second] == [new, new]
    assert second[0].result().usage.cached_prompt_tokens == 0  # the first load's blocks are not the new files'
    assert_idle(engine)


def test_chunked_prefills_and_preemptions_in_a_mixed_batch_match_peft(tiny, adapters) -> None:
    """R7 under pressure: a 7-token budget cuts every prompt into chunks that share steps with
    other adapters' decodes (unequal segments), and a 24-block pool preempts and recomputes;
    each request still gets PEFT's (or the base model's) greedy tokens, and the pool ends empty."""
    root, made = adapters
    _, config, weights = tiny
    engine = Engine(EngineConfig(max_model_len=96, cache=CacheConfig(block_size=4, num_blocks=24),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=16),
                                 lora=LoraConfig(enabled=True, roots=(str(root),), max_loras=2)),
                    config, weights, TOKENIZER, model_fingerprint="tiny")
    for name in ADAPTERS:
        engine.load_lora(spec(name, root))
    preempt, preempted = engine.core.scheduler._preempt, []
    engine.core.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    names = [None, *ADAPTERS]
    requests = [greedy(f"c{i}", PROMPTS[i % len(PROMPTS)], names[i % len(names)], n=20) for i in range(10)]
    expected = [hf_greedy(tiny[0] if r.lora_name is None else made[r.lora_name][1], r.prompt_token_ids, 20)
                for r in requests]
    assert tokens(engine, requests) == expected
    assert preempted, "no preemption: the test would not cover recompute under an adapter"
    assert_idle(engine)


def test_lora_on_a_llava_model_is_refused_at_start(tiny, tmp_path) -> None:
    """R6: PEFT names a LLaVA language model's modules under ``language_model``, which the adapter
    reader does not map: every adapter was refused ("not a LoRA A/B weight ... embedding, lm_head,
    DoRA") while the server advertised LoRA (found by review). Such a server does not start."""
    from dataclasses import replace

    from refengine.lora.registry import LoraRegistry

    llava = replace(tiny[1], architecture="LlavaForConditionalGeneration")
    with pytest.raises(ValueError, match="--enable-lora is not supported for LLaVA models"):
        LoraRegistry(LoraConfig(enabled=True, roots=(str(tmp_path),), max_loras=2), llava)
    LoraRegistry(LoraConfig(enabled=False), llava)  # without LoRA it serves
