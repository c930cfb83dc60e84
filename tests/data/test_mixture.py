"""Data mixtures: token shares, determinism, exact resume, length filters, reads per rank, bad configs.

The share and filter properties run on in-memory sources whose token ids say which source and
document they come from, so the windows are checked token by token, independently of the mixer's
own accounting. The rest runs the real pipeline on two small token stores and on synthetic sources.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from flashcp import plan_shards
from flashcp.data.balance import WindowCost
from flashcp.data.errors import DataError
from flashcp.data.loader import build_loader, WindowLoader, WindowPacker
from flashcp.data.mixture import MixedSource, Part
from flashcp.data.prepare import prepare
from flashcp.data.sources import DataConfig
from flashcp.data.settings import mix_entries
from flashcp.titan.config import ConfigError, load_job, main as config_main
from flashcp.titan.launch.preflight import check_inputs

SOURCE = 10**9  # token id = SOURCE * source + 1000 * document + position (documents < 1000 tokens here)
PLANNER = {"strategy": "per_doc"}


class ListSource:
    """In-memory documents, shuffled per epoch by a seed (a DocSource)."""

    def __init__(self, index: int, lens: list[int], seed: int = 0):
        self.name = self.ident = f"list{index}"
        self.docs = [SOURCE * index + 1000 * i + np.arange(n, dtype=np.int64) for i, n in enumerate(lens)]
        self.seed = seed

    def epoch(self, epoch: int, start: int):
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.docs))
        for position in range(start, len(self.docs)):
            yield position, self.docs[order[position]]


def mixed_loader(weights, lens, seq_len=512, seed=0, filters=None, dp_rank=0, dp_world=1, loop=True):
    parts = [Part(f"s{i}", w / sum(weights), ListSource(i, n, seed), *(filters or {}).get(i, (0, 2**62)), loop)
             for i, (w, n) in enumerate(zip(weights, lens))]  # fmt: skip
    source = MixedSource(parts)
    packer = WindowPacker(source, seq_len, "carry", loop)
    planner = functools.partial(plan_shards, cp_size=1, strategy="per_seq")
    return WindowLoader(packer, planner, {"source": source.ident}, dp_rank, dp_world)


@pytest.mark.parametrize("weights", [(0.4, 0.6), (0.9, 0.1), (1.0, 1.0, 2.0)])
def test_token_shares_over_1000_windows_are_within_2_percent_of_the_weights(weights):
    rng = np.random.default_rng(1)
    # Very different documents: long ones of 200-999 tokens, short ones of 5-40, some in between;
    # and sources of very different sizes, so the small ones loop over many epochs.
    lens = [rng.integers(200, 1000, 40).tolist(), rng.integers(5, 40, 3000).tolist(),
            rng.integers(50, 300, 100).tolist()][: len(weights)]  # fmt: skip
    loader = mixed_loader(weights, lens)
    tokens = np.concatenate([next(loader)["input"].numpy() for _ in range(1000)])
    shares = np.bincount(tokens // SOURCE, minlength=len(weights)) / tokens.size
    assert np.allclose(shares, np.array(weights) / sum(weights), rtol=0.02, atol=0), shares
    assert loader.state_dict()["mix"]["sources"]["s0"][0] >= 5  # its epochs ended; the mixture went on


def test_the_length_filter_keeps_only_documents_within_it():
    lens = [list(range(1, 600, 7)), list(range(1, 600, 5))]
    loader = mixed_loader((0.5, 0.5), lens, seq_len=256, filters={0: (300, 2**62), 1: (0, 99)})
    seen: dict[tuple[int, int], int] = {}
    for _ in range(300):
        tokens = next(loader)["input"].numpy()
        for source, doc in zip(tokens // SOURCE, tokens % SOURCE // 1000):
            seen[(int(source), int(doc))] = lens[source][doc]
    assert {s for s, _ in seen} == {0, 1}
    assert all(n >= 300 for (s, _), n in seen.items() if s == 0)
    assert all(n <= 99 for (s, _), n in seen.items() if s == 1)
    with pytest.raises(DataError, match=r"^\[data.mix.s1\] list1 holds no document of 700 tokens or more \(min_tokens"):
        next(mixed_loader((0.5, 0.5), lens, filters={1: (700, 2**62)}))


def test_without_loop_the_mixture_ends_where_a_source_ends_its_epoch():
    loader = mixed_loader((0.5, 0.5), [[100] * 10, [10] * 1000], seq_len=100, loop=False)
    assert len(list(loader)) == 20  # the 1,000 tokens of source 0 and as many of source 1


# ----------------------------------------------------------------------------- the real pipeline


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    """Two token stores: long documents (~150-450 tokens) and short ones (~10-40)."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, words in (("long", lambda i: 80 + i % 150), ("short", lambda i: 3 + i % 17)):
        corpus = root / f"{name}.jsonl"
        texts = [f"{name} document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words(i)))
                 for i in range(120)]  # fmt: skip
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        out[name] = str(prepare(str(corpus), "default", root / f"{name}_tokens", progress=False))
        out[f"{name}_text"] = str(corpus)
    return out


def mix_cfg(stores, seed=0, text=False, **data) -> DataConfig:
    kind = "_text" if text else ""
    mix = {"long": {"source": stores["long" + kind], "weight": 0.4, "min_tokens": 100},
           "short": {"source": stores["short" + kind], "weight": 0.6}}  # fmt: skip
    return DataConfig(mix=mix, seed=seed, prefetch=data.pop("prefetch", 0), **data)


def batches(cfg, n, seq_len=128, dp_rank=0, dp_world=1, state=None, balance=None, micro=2):
    loader = build_loader(cfg, seq_len, dp_rank, dp_world, planner_kwargs=PLANNER)
    if balance is not None:
        loader.balance_with(micro, WindowCost(dense_per_token=40.0, attn_per_pair=1.0), **balance)
    if state is not None:
        loader.load_state_dict(state)
    with loader:
        out = [next(loader) for _ in range(n)]
        return [(b["input"].tolist(), b["doc_lens"]) for b in out], loader.state_dict(), out


BALANCES = {"off": None, "mesh-cut": {"cut_target": 1.05},
            "deferral": {"max_delay": 4, "cut_target": None, "target": 1.05}}  # fmt: skip


def test_a_mixture_of_stores_gives_the_windows_of_the_same_mixture_of_text(stores):
    """The lazily read store documents (lengths from offsets) mix exactly like tokenised text."""
    balance = BALANCES["deferral"]
    assert batches(mix_cfg(stores), 12)[0] == batches(mix_cfg(stores, text=True), 12)[0]
    assert batches(mix_cfg(stores), 8, balance=balance)[0] == batches(mix_cfg(stores, text=True), 8, balance=balance)[0]


def test_a_mixture_is_deterministic_by_seed(stores):
    first, _, raw = batches(mix_cfg(stores), 8)
    assert first == batches(mix_cfg(stores), 8)[0]
    assert first != batches(mix_cfg(stores, seed=1), 8)[0]
    assert set(raw[-1]["source_tokens"]) == {"long", "short"}


@pytest.mark.parametrize("balance", BALANCES)
def test_resume_with_a_mixture_is_exact_also_under_another_dp_size(stores, balance):
    """A state saved mid-epoch by 2 DP ranks: resumed by 2 ranks, each continues with exactly the
    batches of an uninterrupted run; resumed by 3, the next step holds the stream's next tokens."""
    args, world, steps, micro = BALANCES[balance], 2, 5, 2
    per_step = 1 if args is None else micro
    run = functools.partial(batches, mix_cfg(stores), balance=args, micro=micro)
    saved = [run(steps * per_step, dp_rank=r, dp_world=world) for r in range(world)]
    state = saved[0][1]
    assert all(s[1] == state for s in saved), "every rank saves the same state"
    assert state["mix"]["sources"]["short"][0] == state["mix"]["sources"]["long"][0] == 0  # mid-epoch
    for r in range(world):
        whole = run((steps + 2) * per_step, dp_rank=r, dp_world=world)[0]
        assert run(2 * per_step, dp_rank=r, dp_world=world, state=state)[0] == whole[steps * per_step :]
    if balance == "deferral":  # documents wait across steps: another layout trains another order
        return
    stream = [run(per_step, dp_rank=r, dp_world=3, state=state)[0] for r in range(3)]
    plain = [batches(mix_cfg(stores), per_step, dp_rank=r, dp_world=3, state=state)[0] for r in range(3)]
    tokens = lambda rank_batches: sorted(t for b in rank_batches for tokens, _ in b for t in tokens)  # noqa: E731
    assert tokens(stream) == tokens(plain)  # the same tokens, balanced or in stream order
    flat = batches(mix_cfg(stores), steps * world * per_step + 3 * per_step)[0][steps * world * per_step :]
    assert sorted(t for tokens, _ in flat for t in tokens) == tokens(plain)


def balanced_loaders(balance: str, world: int, micro: int) -> list[WindowLoader]:
    """Every DP rank's loader of a mixture whose long documents (300-900 tokens) outlast a window."""
    rng = np.random.default_rng(0)
    lens = [rng.integers(300, 900, 50).tolist(), rng.integers(5, 60, 2000).tolist()]
    loaders = [mixed_loader((0.4, 0.6), lens, seq_len=256, dp_rank=r, dp_world=world) for r in range(world)]
    if BALANCES[balance] is not None:
        for loader in loaders:
            loader.balance_with(micro, WindowCost(dense_per_token=40.0, attn_per_pair=1.0), **BALANCES[balance])
    return loaders


@pytest.mark.parametrize("balance", BALANCES)
def test_each_step_counts_the_tokens_per_source_of_its_windows_from_the_first_step(balance):
    """On every rank, the batches of a step (one round of DP windows, or a balanced step) add the
    tokens of each source that all ranks' windows of the step hold, and `source_tokens` sums them
    over the steps so far: from the first step, where no long document (longer than a window) has
    ended yet (counting finished documents showed nothing there), and under deferral, where
    documents wait for later steps (their tokens count in the step that trains them)."""
    world, micro = 2, 2
    per_step = 1 if BALANCES[balance] is None else micro
    loaders, so_far, delayed = balanced_loaders(balance, world, micro), np.zeros(2, dtype=np.int64), 0.0
    for step in range(10):
        out = [[next(loader) for _ in range(per_step)] for loader in loaders]
        tokens = np.concatenate([b["input"].numpy() for rank in out for b in rank])
        in_windows = np.bincount(tokens // SOURCE, minlength=2)
        so_far += in_windows
        for rank in out:
            assert [sum(b["new_source_tokens"][f"s{i}"] for b in rank) for i in range(2)] == in_windows.tolist()
            assert rank[-1]["source_tokens"] == {"s0": so_far[0], "s1": so_far[1]}, step
        delayed += out[0][-1].get("deferral", {}).get("delayed_tokens", 0.0)
    assert so_far.min() > 0 and (balance != "deferral" or delayed > 0)


@pytest.mark.parametrize("balance", BALANCES)
def test_a_resumed_loader_counts_on_as_an_uninterrupted_one_whatever_counts_its_state_holds(balance):
    """The counts in a state are never loaded but recomputed from its cursor and pending documents:
    a state of an older version (which counted finished documents only) resumes with the counts of
    an uninterrupted run."""
    micro = 2
    per_step = 1 if BALANCES[balance] is None else micro
    whole = balanced_loaders(balance, 1, micro)[0]
    counts = lambda b: (b["source_tokens"], b["new_source_tokens"])  # noqa: E731
    expected = [counts(next(whole)) for _ in range(6 * per_step)]
    first = balanced_loaders(balance, 1, micro)[0]
    for _ in range(3 * per_step):
        next(first)
    state = first.state_dict()
    state["mix"]["tokens"] = {"s0": 0, "s1": 0}
    resumed = balanced_loaders(balance, 1, micro)[0]
    resumed.load_state_dict(state)
    assert [counts(next(resumed)) for _ in range(3 * per_step)] == expected[3 * per_step :]


@pytest.mark.parametrize("text", [False, True])
def test_a_prefetching_mixture_saves_the_state_of_the_last_batch_handed_out(stores, text):
    plain, _, _ = batches(mix_cfg(stores, text=text), 9)
    _, state, _ = batches(mix_cfg(stores, text=text, prefetch=3), 4)
    assert batches(mix_cfg(stores, text=text), 5, state=state)[0] == plain[4:]


def test_each_rank_reads_only_its_own_windows_from_the_stores(stores, store_reads):
    mine, _, _ = batches(mix_cfg(stores), 3, dp_rank=5, dp_world=8)
    pieces = sum(len(doc_lens) for _, doc_lens in mine)
    assert 0 < len(store_reads) <= pieces  # documents of the other 7 ranks' windows are never read
    assert sum(store_reads) < 3 * 128 + 2 * 3 * 450  # far below the 8 x 3 windows of the steps walked


def test_a_state_of_another_mixture_is_refused(stores):
    _, state, _ = batches(mix_cfg(stores), 2)
    other = DataConfig(mix={"long": {"source": stores["long"], "weight": 0.5, "min_tokens": 100},
                            "short": {"source": stores["short"], "weight": 0.6}}, prefetch=0)  # fmt: skip
    with pytest.raises(DataError, match="packing changed .*source: saved 'mix:long=0.4:100-"):
        batches(other, 1, state=state)
    single = {k: v for k, v in state.items() if k != "mix"}
    with pytest.raises(DataError, match=r"holds the mixer of sources \[\], not of \['long', 'short'\]"):
        batches(mix_cfg(stores), 1, state=single)


# ----------------------------------------------------------------------------- configs


def job(tmp_path: Path, text: str, *overrides: str) -> dict:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_job(path, list(overrides))


MIX = """
[data.mix.long]
source = "synthetic"
weight = 0.4
min_tokens = 100
[data.mix.short]
source = "synthetic"
weight = 0.6
"""


def test_a_mixture_from_toml_and_command_line_overrides(tmp_path):
    cfg = job(tmp_path, MIX, "--data.mix.long.weight", "2", "--data.mix.short.max_tokens=50")
    assert cfg["data"]["mix"] == {"long": {"source": "synthetic", "weight": 2, "min_tokens": 100},
                                  "short": {"source": "synthetic", "weight": 0.6, "max_tokens": 50}}  # fmt: skip
    assert job(tmp_path, "[data]\nsource = 'synthetic'\n")["data"]["mix"] == {}  # one source, as before


@pytest.mark.parametrize("text, overrides, message", [
    (MIX.replace("weight = 0.4", "wieght = 0.4"), [],
     r"\[data.mix.long\] wieght: unknown key; allowed keys: source, weight, min_tokens, max_tokens, text_field"),
    (MIX, ["--data.mix.short.weight", "0"], r"\[data.mix.short\] weight must be > 0 \(a share of the tokens\), got 0"),
    (MIX, ["--data.mix.short.weight", "-1"], r"\[data.mix.short\] weight must be > 0"),
    (MIX, ["--data.mix.short.weight", "lots"], r"\[data.mix.short\] weight must be a finite number, got 'lots'"),
    (MIX.replace("weight = 0.6", ""), [], r"\[data.mix.short\] weight is missing"),
    (MIX + "[data.mix.long]\nsource = 'default'\nweight = 1\n", [], r"is not valid TOML: .*long"),
    (MIX, ["--data.mix.long.max_tokens", "99"], r"\[data.mix.long\] min_tokens \(100\) and max_tokens \(99\)"),
    (MIX, ["--data.source", "synthetic"], r"data.source \('synthetic'\) and data.mix are exclusive"),
    (MIX, ["--data.mix.long.shuffle", "3"], r"\[data.mix.long\] shuffle must be bool, got 3"),
    (MIX, ["--data.mix.long.txt_sample_by", "word"], r"\[data.mix.long\] data.txt_sample_by must be one of"),
    (MIX + "[data.mix.'a b']\nsource = 'x'\nweight = 1\n", [], r"\[data.mix.a b\]: a source's name may hold only"),
    ("[data]\nmix = 3\n", [], r"\[data\] mix must be a table.*, got 3"),
])  # fmt: skip
def test_bad_mixtures_fail_with_one_line_naming_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        job(tmp_path, text, *overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("long, short, message", [
    ("1e308", "1e308", None),  # their sum overflows a float: the shares are still 1/2 each
    ("inf", "0.6", "[data.mix.long] weight must be a finite number, got inf"),
    ("nan", "0.6", "[data.mix.long] weight must be a finite number, got nan"),
    ("-1", "0.6", "[data.mix.long] weight must be > 0 (a share of the tokens), got -1"),
    ("1e308", "1e-320", "[data.mix.short] weight 1e-320 is no share of the tokens beside 1e+308"),
])  # fmt: skip
def test_weights_out_of_range_are_one_line_from_the_config_check(tmp_path, capsys, long, short, message):
    path = tmp_path / "job.toml"
    path.write_text(MIX)
    argv = ["--check", str(path), "--data.mix.long.weight", long, "--data.mix.short.weight", short]
    assert config_main(argv) == (2 if message else 0)
    err = capsys.readouterr().err
    if message is None:
        assert err == ""
        assert [e.share for e in mix_entries(DataConfig(**load_job(path, argv[2:])["data"]))] == [0.5, 0.5]
    else:
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_the_launch_check_opens_every_source_and_refuses_a_filter_that_keeps_nothing(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([20, 40, 60, 120, 200]))
    text = MIX.replace('source = "synthetic"', f'source = "synthetic"\nsynthetic_lengths = "{lengths}"')
    assert check_inputs(job(tmp_path, text)) > 0
    with pytest.raises(DataError, match=r"^\[data.mix.long\] synthetic documents with .* lengths holds no document"):
        check_inputs(job(tmp_path, text.replace("min_tokens = 100", "min_tokens = 100\nmax_tokens = 110")))
    nowhere = MIX.replace('weight = 0.6', 'weight = 0.6\nsynthetic_lengths = "nowhere.json"')
    with pytest.raises(DataError, match=r"^\[data.mix.short\] data.synthetic_lengths: .*nowhere.json"):
        check_inputs(job(tmp_path, nowhere))
