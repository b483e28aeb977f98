"""Mixture weights that used to go silently wrong: non-finite weights, tiny weights that
make a ``"repeat"`` mixture run nearly forever, and components that hold no sample.

Every case runs over real JSONL files written to ``tmp_path``.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path

import pytest
from corpus import documents, write_jsonl
from memsource import MemDataset

import zephon_torch as zt
from zephon_torch.sources.schedule import WorkSchedule

zd = zt.sources


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    """Two 20-document JSONL files and one whose lines are all blank."""
    out = {}
    for name, seed in (("web", 1), ("code", 2)):
        out[name] = str(write_jsonl(tmp_path / f"{name}.jsonl",
                                    documents(20, seed, prefix=f"{name} ")))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n   \n\n")
    out["blank"] = str(blank)
    return out


def _sources(files: dict[str, str], names: list[str], tmp_path: Path) -> list:
    return [zd.jsonl(files[n], component_id=i, name=n, cache_dir=tmp_path / "cache")
            for i, n in enumerate(names)]


def _pipe(files, names, weights, tmp_path, **kw) -> zt.Pipeline:
    return (zt.Pipeline.from_sources(_sources(files, names, tmp_path), weights,
                                     num_lanes=kw.pop("num_lanes", 2), chunk_size=8, **kw)
            .fetch().decode_text())


def _texts(pipe: zt.Pipeline) -> list[str]:
    return [r.payload["text"] for r in pipe.iter(runner="inline")]


# ---------------------------------------------------------------- item 2: non-finite weights


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("form", ["list", "mapping"])
def test_a_non_finite_weight_is_refused_naming_the_dataset_and_value(files, tmp_path, bad,
                                                                      form) -> None:
    weights = [1.0, bad] if form == "list" else {0: 1.0, 1: bad}
    with pytest.raises(ValueError) as info:
        _pipe(files, ["web", "code"], weights, tmp_path)
    message = str(info.value)
    assert "finite" in message
    assert f"dataset 'code' (component 1) has weight {bad!r}" in message
    assert "give each component its share" in message


def test_weights_whose_sum_overflows_are_refused(files, tmp_path) -> None:
    # Each finite, but the sum is inf: every share would be 0 and the stream empty.
    with pytest.raises(ValueError, match=r"got \[1e\+308, 1e\+308\], whose sum is inf.*scale"):
        _pipe(files, ["web", "code"], [1e308, 1e308], tmp_path)


def test_ensure_mixture_refuses_targets_whose_sum_overflows() -> None:
    with pytest.raises(ValueError, match=r"mixture sum to inf .*scale them down"):
        zt.Pipeline.from_items(["a"]).ensure_mixture(mixture={0: 1e308, 1: 1e308})


def test_an_infinite_weight_is_refused_by_the_schedule_too() -> None:
    a, b = MemDataset(list(range(5)), component_id=0), MemDataset(list(range(5)), component_id=1)
    with pytest.raises(ValueError, match=r"dataset 'mem' \(component 1\) has weight inf"):
        WorkSchedule([a, b], chunk_size=4, num_lanes=1, weights=[1, math.inf])


# ---------------------------------------------------------------- item 3: tiny weights


def _walk_positions(schedule: WorkSchedule) -> int:
    state, total = schedule.initial_state(), 0
    while True:
        components, state = schedule.advance(state)
        if components is None:
            return total
        total += len(components)


@pytest.mark.parametrize(("sizes", "weights", "exhausted", "passes"), [
    ([20, 20], [1, 1e-3], "repeat", 1),
    ([20, 20], [1, 1e-2], "repeat", 2),
    ([20, 35], [0.3, 0.7], "repeat", 1),
    ([50, 10, 7], [0.5, 0.01, 0.49], "repeat", 1),
    ([50, 10, 7], [0.5, 0.01, 0.49], "stop", 1),
    ([20, 20], [1, 1e-3], "stop", 1),
    ([30, 10], None, "repeat", 3),
])
def test_the_expected_length_is_close_to_the_real_walk(sizes, weights, exhausted,
                                                       passes) -> None:
    datasets = [MemDataset(list(range(n)), component_id=i) for i, n in enumerate(sizes)]
    schedule = WorkSchedule(datasets, chunk_size=16, num_lanes=3, weights=weights,
                            exhausted=exhausted, passes=passes)
    real = _walk_positions(schedule)
    # Within one step of the smallest share of where the estimate says it ends.
    slack = 1 / min(w for w in schedule.weights if w > 0) + len(sizes)
    assert abs(schedule.expected_positions - real) <= slack, (schedule.expected_positions, real)


def test_a_tiny_weight_warns_before_the_first_item_with_the_length_and_the_way_out(
        files, tmp_path) -> None:
    pipe = _pipe(files, ["web", "code"], [1, 1e-3], tmp_path, passes=1)
    with pytest.warns(RuntimeWarning) as caught:
        it = pipe.iter(runner="inline")  # no item read yet
    [warning] = [w for w in caught if "exhausted='repeat'" in str(w.message)]
    message = str(warning.message)
    assert "'web' (component 0) 0.999, 'code' (component 1) 0.000999" in message
    # It says how long, how many times 'web' is read, and how to bound it.
    expected = int(message.split("about ")[1].split(" samples")[0].replace(",", ""))
    assert "40 samples" in message  # what the passes hold
    assert "'web' (component 0) is read about 1,0" in message  # about a thousand times
    assert "exhausted='stop'" in message and "weight 0" in message
    count = sum(1 for _ in it)
    assert abs(count - expected) <= 1 / (1e-3 / 1.001) + 2
    assert count > 10 * 40


def test_the_long_mixture_warning_comes_from_num_batches_too(files, tmp_path) -> None:
    # fetch() alone keeps the count exact, so num_batches walks the schedule: it warns first.
    pipe = zt.Pipeline.from_sources(_sources(files, ["web", "code"], tmp_path), [1, 1e-2],
                                    num_lanes=2, chunk_size=8).fetch()
    with pytest.warns(RuntimeWarning, match=r"exhausted='repeat'.* about 2,0\d\d samples"):
        count = pipe.num_batches(rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert count == sum(1 for _ in pipe.iter(runner="inline"))


def test_weight_zero_leaves_a_dataset_out_without_warning(files, tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        texts = _texts(_pipe(files, ["web", "code"], [1, 0], tmp_path))
    assert len(texts) == 20 and all(t.startswith("web ") for t in texts)


def test_a_tiny_weight_with_stop_ends_with_the_big_dataset_without_warning(files,
                                                                           tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        texts = _texts(_pipe(files, ["web", "code"], [1, 1e-3], tmp_path, exhausted="stop"))
    assert Counter(t.split()[0] for t in texts)["web"] == 20
    assert len(texts) <= 21


def test_an_upsampled_small_dataset_within_the_factor_does_not_warn(files,
                                                                    tmp_path) -> None:
    # web 20 at 0.9 and code 20 at 0.1: code finishes its pass at about 200 samples,
    # where web has been read 9 times: under the factor of 10, so no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        texts = _texts(_pipe(files, ["web", "code"], [0.9, 0.1], tmp_path))
    assert 180 <= len(texts) <= 210


@pytest.mark.parametrize("weight", [1e-300, 5e-324])
def test_an_absurdly_small_weight_is_refused_before_anything_runs(files, tmp_path,
                                                                  weight) -> None:
    pipe = _pipe(files, ["web", "code"], [1, weight], tmp_path)
    with pytest.raises(ValueError) as info:
        pipe.iter(runner="inline")
    message = str(info.value)
    assert "'code'" in message and f"{weight:.3g}" in message
    assert "exhausted='stop'" in message and "weight 0" in message


# ---------------------------------------------------------------- item 4: empty components


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
@pytest.mark.parametrize("form", ["list", "mapping"])
def test_an_empty_component_with_a_share_is_an_error_naming_it_and_its_files(
        files, tmp_path, exhausted, form) -> None:
    weights = [0.5, 0.5] if form == "list" else {0: 0.5, 1: 0.5}
    pipe = _pipe(files, ["web", "blank"], weights, tmp_path, exhausted=exhausted)
    with pytest.raises(ValueError) as info:
        pipe.iter(runner="inline")
    message = str(info.value)
    assert "dataset 'blank' (component 1)" in message
    assert "holds no samples" in message and "blank.jsonl" in message
    assert "weight 0" in message  # what to do
    counted = zt.Pipeline.from_sources(_sources(files, ["web", "blank"], tmp_path), weights,
                                       num_lanes=2, chunk_size=8, exhausted=exhausted).fetch()
    with pytest.raises(ValueError, match=r"dataset 'blank' .*holds no samples"):
        counted.num_batches(rank=0, world_size=1)


def test_an_empty_component_without_a_share_is_fine(files, tmp_path) -> None:
    for weights in ([1, 0], {0: 1.0}, None):
        texts = _texts(_pipe(files, ["web", "blank"], weights, tmp_path))
        assert len(texts) == 20


def test_an_empty_file_beside_a_full_one_in_a_component_is_fine(files, tmp_path) -> None:
    # The component holds samples; the empty file simply adds none.
    both = zd.jsonl([files["code"], files["blank"]], component_id=1, name="code",
                    cache_dir=tmp_path / "cache")
    web = zd.jsonl(files["web"], component_id=0, name="web", cache_dir=tmp_path / "cache")
    pipe = zt.Pipeline.from_sources([web, both], {0: 0.5, 1: 0.5}, num_lanes=2,
                                    chunk_size=8, exhausted="stop").fetch().decode_text()
    texts = _texts(pipe)
    assert Counter(t.split()[0] for t in texts) == {"web": 20, "code": 20}


def test_ensure_mixture_refuses_a_target_that_no_source_feeds(files, tmp_path) -> None:
    # The sources leave 'blank' out (weights by size); ensure_mixture asks for 50/50.
    pipe = _pipe(files, ["web", "blank"], None, tmp_path).ensure_mixture(
        weight_by="samples", mixture={0: 1, 1: 1})
    with pytest.raises(ValueError) as info:
        list(pipe.iter(runner="inline"))
    message = str(info.value)
    assert "ensure_mixture" in message and "component 1" in message
    assert "'blank'" in message and "blank.jsonl" in message
    # A component no source has at all.
    pipe = _pipe(files, ["web", "code"], None, tmp_path).ensure_mixture(
        weight_by="samples", mixture={0: 1, 1: 1, 2: 1})
    with pytest.raises(ValueError, match=r"component 2.*no source"):
        list(pipe.iter(runner="inline"))


def test_ensure_mixture_over_fed_components_still_runs(files, tmp_path) -> None:
    pipe = _pipe(files, ["web", "code"], None, tmp_path).ensure_mixture(
        weight_by="samples", mixture={0: 1, 1: 1, 2: 0})
    assert len(_texts(pipe)) == 40


def test_the_troubleshooting_page_lists_the_new_messages() -> None:
    page = (Path(__file__).parent.parent / "docs" / "troubleshooting.md").read_text()
    for start in ("has weight inf", "holds no samples", "exhausted='repeat'",
                  "no sample of component"):
        assert start in page, start
