"""``megastart bench loader`` at a tiny size: the report has every figure, and every
strategy loaded exactly megastart's weights, with the page cache dropped before
every load and with it warm (speed is reported, never asserted)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from megastart.cli import main
from megastart.harness.launch import RankPool

STRATEGIES = ("megastart", "megastart_shm", "every_rank_full", "stage_reader", "mmap_slices")


def run_bench(out: Path, *arguments: str) -> tuple[dict, str]:
    """``megastart bench loader`` with ``arguments``, writing into ``out``: its JSON and stdout."""
    capture = out / "stdout.txt"
    with capture.open("w") as stdout, contextlib.redirect_stdout(stdout):
        code = main(
            ["bench", "loader", *arguments, f"--workdir={out}", f"--json={out / 'bench.json'}"]
        )
    assert code == 0, capture.read_text()
    return json.loads((out / "bench.json").read_text()), capture.read_text()


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    return run_bench(out, "--ranks=4", "--tp=2", "--pp=2", "--size-gb=0.005")


def runs(results: dict) -> list[dict]:
    """The cold run (the JSON's top level) and the warm one (its ``warm`` key)."""
    return [results, results["warm"]]


def test_the_default_measures_cold_then_warm(bench: tuple[dict, str]) -> None:
    results, table = bench
    assert [run["page_cache"] for run in runs(results)] == ["cold", "warm"]
    assert table.index("page cache cold") < table.index("page cache warm")
    cold, warm = (run["strategies"]["megastart"]["checksums"] for run in runs(results))
    assert cold == warm


@pytest.mark.parametrize("condition", [0, 1], ids=["cold", "warm"])
def test_json_has_every_figure_for_every_strategy(bench: tuple[dict, str], condition: int) -> None:
    results = runs(bench[0])[condition]
    assert results["checkpoint_bytes"] > 0
    assert set(results["strategies"]) == set(STRATEGIES)
    for name, figures in results["strategies"].items():
        for key in ("wall_s", "node_peak_bytes", "bytes_read"):
            assert figures[key] > 0, (name, key, figures[key])
        assert 0 <= figures["transient_bytes"] <= figures["node_peak_bytes"]
    assert results["limits"]["read_gbps"] > 0
    assert results["limits"]["broadcast_gbps"] > 0


@pytest.mark.parametrize("condition", [0, 1], ids=["cold", "warm"])
def test_every_strategy_loads_megastarts_weights_on_every_rank(
    bench: tuple[dict, str], condition: int
) -> None:
    results, table = runs(bench[0])[condition], bench[1]
    reference = results["strategies"]["megastart"]["checksums"]
    assert len(reference) == 4 and len(set(reference)) == 4  # four different shards
    for name, figures in results["strategies"].items():
        assert figures["checksums"] == reference, name
        assert figures["weights_match_megastart"], name
        assert f"{name} " in table


def test_load_changed_the_randomly_initialised_weights(
    bench: tuple[dict, str], rank_pools: dict[int, RankPool]
) -> None:
    """Equal checksums would prove nothing if no strategy had written anything."""
    from megastart.bench import strategies

    results, _ = bench
    pool = rank_pools[4]
    pool.run(strategies.build_model, results["checkpoint"], results["layout"])
    try:
        unloaded = pool.run(strategies.checksum)
    finally:
        pool.run(strategies.teardown)
    assert all(
        a != b
        for a, b in zip(unloaded, results["strategies"]["megastart"]["checksums"], strict=True)
    )


@pytest.mark.parametrize("condition", [0, 1], ids=["cold", "warm"])
def test_bytes_read_follow_each_strategys_io_pattern(
    bench: tuple[dict, str], condition: int
) -> None:
    results = runs(bench[0])[condition]
    size = results["checkpoint_bytes"]
    read = {name: figures["bytes_read"] for name, figures in results["strategies"].items()}
    # megastart reads each tensor once: the checkpoint minus the safetensors headers.
    assert 0.99 * size <= read["megastart"] <= size
    # every rank reads every tensor.
    assert read["every_rank_full"] == 4 * read["megastart"]
    # with untied embeddings, TP rank 0 of each of the two stages reads its half once.
    assert read["stage_reader"] == read["megastart"]
    # every rank reads its TP slices: each sharded tensor once per stage, the norms twice.
    assert read["megastart"] <= read["mmap_slices"] < 1.1 * read["megastart"]


@pytest.fixture(scope="module")
def two_nodes(
    bench: tuple[dict, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict, str]:
    """TP2 x PP2 on two simulated nodes of two ranks, megastart once per reader (``--readers
    global,striped``) with ``--read-gbps``, on the checkpoint the ``bench`` run generated."""
    return run_bench(
        tmp_path_factory.mktemp("nodes"),
        "--ranks=4",
        "--tp=2",
        "--pp=2",
        "--ranks-per-node=2",
        f"--checkpoint={bench[0]['checkpoint']}",
        "--strategies=megastart",
        "--readers=global,striped",
        "--read-gbps=1",
        "--transport=gloo",
        "--page-cache=warm",
    )


def test_two_simulated_nodes_send_the_second_only_what_it_needs(
    bench: tuple[dict, str], two_nodes: tuple[dict, str]
) -> None:
    """Node 1 holds stage 1, so less than the checkpoint crosses between the nodes, and each
    rank's weights are those every strategy loaded on one node."""
    results, table = two_nodes
    between = results["strategies"]["megastart[global]"]["bytes_between_nodes"]
    assert 0 < between < results["checkpoint_bytes"]
    one_node = bench[0]["strategies"]["mmap_slices"]["checksums"]
    assert results["strategies"]["megastart[global]"]["checksums"] == one_node
    assert "2 simulated nodes of 2 ranks" in table


def test_readers_run_megastart_once_per_reader_each_reading_the_checkpoint_once(
    two_nodes: tuple[dict, str],
) -> None:
    """``--readers global,striped``: two megastart rows with the same weights, each reading
    the checkpoint once; ``--read-gbps`` is reported."""
    results, table = two_nodes
    rows = results["strategies"]
    assert list(rows) == ["megastart[global]", "megastart[striped]"]
    assert rows["megastart[global]"]["checksums"] == rows["megastart[striped]"]["checksums"]
    read = {figures["bytes_read"] for figures in rows.values()}
    assert len(read) == 1 and 0.99 * results["checkpoint_bytes"] <= read.pop()
    assert results["read_gbps"] == 1
    assert "--read-gbps 1: every process's reads" in table
    assert set(results["targets"]) >= {"striped_vs_global", "striped_bytes_read"}
    assert "NCCL" not in table  # its limit is measured with --transport nccl only


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("device", "refusal"),
    [
        ("cpu", "--transport nccl needs --device cuda"),
        ("cuda", "--transport nccl needs CUDA, and this machine has none"),
    ],
)
def test_nccl_transport_is_refused_before_any_rank_starts_where_it_cannot_run(
    device: str, refusal: str
) -> None:
    with pytest.raises(SystemExit, match=refusal):
        main(
            [
                "bench",
                "loader",
                "--ranks=2",
                "--tp=1",
                "--pp=2",
                "--ranks-per-node=1",
                f"--device={device}",
                "--transport=nccl",
            ]
        )
