"""The TieredKVConnector serves a history only to a request vLLM's own prefix cache would
let share it, and only with the weights that computed it: real vLLM engines (CPU), a tiny
random Llama saved with ``save_pretrained``, two random LoRA adapters in PEFT's format,
an SSD tier that outlives each engine. Each engine runs in a fresh interpreter, with vLLM's
engine core and worker in it (``IN_PROCESS``: it starts in half the time).

One engine serves turns under adapter A, under tenant salt ``tenant-a`` and under
neither, then continues each under the other identities: only the same identity is
served (``num_cached_tokens``; vLLM's prefix cache is off, so a cached token is one the
connector loaded), and every answer equals the same prompt computed from scratch (the
same request under a salt no one else uses). A restart with the same files serves again;
after the checkpoint is rewritten in place with other random weights, and after another
model is saved over the same directory, nothing stored before is served.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.vllm_support import IN_PROCESS, require_vllm, tiny_model

require_vllm()

from tests.integration.identity_engine import Answer, Ask, Result, Spec, run_engine  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

BLOCK = 32
HIDDEN, KV_HEADS, HEAD = 256, 2, 64


def lora_adapter(directory: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter for :func:`tiny_model` (q and v projections of its 2 layers),
    written as PEFT writes one (``adapter_config.json``, ``adapter_model.safetensors``)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV_HEADS * HEAD)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def run(spec: Spec, work: Path) -> Result:
    return run_engine(spec, work, IN_PROCESS)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


class World:
    """The model directory, the adapters, the SSD tier and each engine's result."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = tiny_model(root / "model", seed=0)
        self.adapters = {
            "A": str(lora_adapter(root / "lora-a", seed=1)),
            "B": str(lora_adapter(root / "lora-b", seed=2)),
        }
        self.extra = {"host_bytes": 64 << 20, "ssd_path": str(root / "kv"), "fsync": False}
        self.rng = random.Random(11)

    def spec(self, conversations: list[list[int]], rounds: list[list[Ask]]) -> Spec:
        return Spec(
            model=str(self.model),
            extra=self.extra,
            conversations=conversations,
            rounds=rounds,
            adapters=self.adapters,
        )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("vllm-identity"))


def served(answer: Answer) -> bool:
    return answer.cached >= 2 * BLOCK  # the stored conversation's full blocks


@pytest.fixture(scope="module")
def first(world: World) -> tuple[Spec, Result]:
    """Three conversations stored under adapter A, salt ``tenant-a`` and neither, then
    continued under every identity (and from scratch, under salts no one else uses)."""
    rng = world.rng
    convs = [tokens(rng, 70) for _ in range(3)]
    q = [tokens(rng, 10) for _ in range(3)]
    rounds = [
        [
            Ask(conv=0, lora="A", keep=True),
            Ask(conv=1, salt="tenant-a", keep=True),
            Ask(conv=2, keep=True),
        ],
        [
            Ask(conv=0, query=q[0], lora="B"),  # 0: another adapter
            Ask(conv=0, query=q[0], lora="A"),  # 1: the same adapter
            Ask(conv=0, query=q[0], lora="A", salt="ref-1"),  # 2: 1 from scratch
            Ask(conv=0, query=q[0], lora="B", salt="ref-2"),  # 3: 0 from scratch
            Ask(conv=0, query=q[0]),  # 4: no adapter
            Ask(conv=1, query=q[1], salt="tenant-b"),  # 5: another tenant
            Ask(conv=1, query=q[1], salt="tenant-a", keep=True),  # 6: the same tenant
            Ask(conv=1, query=q[1]),  # 7: no salt
            Ask(conv=1, query=q[1], salt="ref-3"),  # 8: 5, 6 and 7 from scratch
            Ask(conv=2, query=q[2], keep=True),  # 9: the same (no adapter, no salt)
            Ask(conv=2, query=q[2], lora="A"),  # 10: an adapter
            Ask(conv=2, query=q[2], lora="A", salt="ref-4"),  # 11: 10 from scratch
            Ask(conv=2, query=q[2], salt="ref-5"),  # 12: 9 from scratch
            Ask(conv=0, query=q[0], salt="ref-6"),  # 13: 4 from scratch
        ],
    ]
    spec = world.spec(convs, rounds)
    return spec, run(spec, world.root / "run1")


def test_only_the_same_adapter_and_salt_are_served(first: tuple[Spec, Result]) -> None:
    _, result = first
    a = result.rounds[1]
    assert [served(x) for x in a] == [
        False,  # adapter B is not served adapter A's history
        True,
        False,
        False,
        False,  # the base model is not served adapter A's history
        False,  # tenant B is not served tenant A's history
        True,
        False,  # nor is a request without a salt
        False,
        True,
        False,  # adapter A is not served the base model's history
        False,
        False,
        False,
    ], [x.cached for x in a]
    # every answer equals the same request computed from scratch
    for got, ref in ((1, 2), (0, 3), (5, 8), (6, 8), (7, 8), (9, 12), (10, 11), (4, 13)):
        assert a[got].answer == a[ref].answer, (got, ref)
    # the adapters change the answers (a request served another's KV would show it)
    assert len({tuple(a[i].answer) for i in (2, 3, 13)}) == 3


@pytest.fixture(scope="module")
def queries(world: World) -> list[list[int]]:
    return [tokens(world.rng, 10) for _ in range(4)]


@pytest.fixture(scope="module")
def second(world: World, first: tuple[Spec, Result], queries: list[list[int]]) -> Result:
    """A restart over the same files and the same SSD tier."""
    q = queries[0]
    rounds = [
        [
            Ask(conv=2, query=q, keep=True),
            Ask(conv=2, query=q, salt="ref-1"),
            Ask(conv=0, query=q, lora="A", keep=True),
            Ask(conv=0, query=q, lora="A", salt="ref-2"),
        ]
    ]
    return run(world.spec(first[1].prompts, rounds), world.root / "run2")


@pytest.fixture(scope="module")
def third(world: World, second: Result, queries: list[list[int]]) -> Result:
    """The checkpoint rewritten in place: the same path and file names, other weights."""
    tiny_model(world.model, seed=5)
    q, q2 = queries[1], queries[2]
    rounds = [
        [
            Ask(conv=2, query=q, keep=True),
            Ask(conv=2, query=q, salt="ref-1"),
            Ask(conv=0, query=q, lora="A"),
            Ask(conv=0, query=q, lora="A", salt="ref-2"),
        ],
        [Ask(conv=2, query=q2), Ask(conv=2, query=q2, salt="ref-3")],
    ]
    return run(world.spec(second.prompts, rounds), world.root / "run3")


@pytest.fixture(scope="module")
def fourth(world: World, third: Result, queries: list[list[int]]) -> Result:
    """Another model (another MLP width, the same KV layout) saved over the directory."""
    for path in world.model.iterdir():
        path.unlink()
    tiny_model(world.model, seed=6, intermediate=384)
    q = queries[3]
    rounds = [[Ask(conv=2, query=q), Ask(conv=2, query=q, salt="ref-1")]]
    return run(world.spec(third.prompts, rounds), world.root / "run4")


def test_a_restart_with_the_same_files_serves_again(second: Result) -> None:
    a = second.rounds[0]
    assert [served(x) for x in a] == [True, False, True, False], [x.cached for x in a]
    assert a[0].answer == a[1].answer
    assert a[2].answer == a[3].answer


def test_a_checkpoint_rewritten_in_place_is_not_served_the_old_weights_kv(
    third: Result,
) -> None:
    a, b = third.rounds
    assert [served(x) for x in a] == [False] * 4, [x.cached for x in a]
    assert a[0].answer == a[1].answer
    assert a[2].answer == a[3].answer
    # what the new weights store, they serve
    assert [served(x) for x in b] == [True, False], [x.cached for x in b]
    assert b[0].answer == b[1].answer


def test_another_model_over_the_same_directory_is_not_served(fourth: Result) -> None:
    a = fourth.rounds[0]
    assert [served(x) for x in a] == [False, False], [x.cached for x in a]
    assert a[0].answer == a[1].answer
