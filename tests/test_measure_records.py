"""Records: the schema contract, round trip through a file, upsert by key."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from attnlab.measure import records as rec
from attnlab.shapes import AttentionShape

SHAPE = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=4096, seqlen_k=4096)
ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "driver": "580.65",
       "git_commit": "abc123", "timestamp": "2026-11-29T12:00:00+00:00",
       "command": "attnlab bench --providers sdpa_flash --seqlens 4096"}


def latency(p50: float = 1.0, provider: str = "sdpa_flash", shape=SHAPE, **changes) -> dict:
    fields = dict(kernel="call", provider=provider, phase="prefill", shape=shape,
                  metric="latency", unit="ms", p20=p50 * 0.9, p50=p50, p80=p50 * 1.1,
                  repeats=50, env=ENV, tflops=300.0, tbps=0.1,
                  kernel_names=["void pytorch_flash::flash_fwd_kernel<...>"])
    fields.update(changes)
    return rec.make_record(**fields)


def test_record_has_exactly_the_contract_keys():
    record = latency()
    assert tuple(record) == rec.RECORD_KEYS
    assert record["shape"] == SHAPE.as_dict()
    assert AttentionShape.from_dict(record["shape"]) == SHAPE


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "bench.jsonl"
    records = [latency(1.0), latency(2.0, provider="sdpa_cudnn"),
               rec.skipped_record(provider="flash_attn", phase="prefill", shape=SHAPE,
                                  reason="flash_attn is not importable", env=ENV)]
    assert rec.upsert_records(path, records) == (3, 0)
    assert rec.load_records(path) == records
    # one JSON object per line
    assert [json.loads(line)["provider"] for line in path.read_text().splitlines()] == \
        ["sdpa_flash", "sdpa_cudnn", "flash_attn"]


def test_upsert_replaces_by_key_and_keeps_order(tmp_path):
    path = tmp_path / "bench.jsonl"
    rec.upsert_records(path, [latency(1.0), latency(2.0, provider="sdpa_cudnn")])
    other_shape = SHAPE.replace(seqlen_q=1024, seqlen_k=1024)
    added, replaced = rec.upsert_records(path, [latency(5.0), latency(3.0, shape=other_shape)])
    assert (added, replaced) == (1, 1)
    stored = rec.load_records(path)
    assert [(r["provider"], r["p50"]) for r in stored] == \
        [("sdpa_flash", 5.0), ("sdpa_cudnn", 2.0), ("sdpa_flash", 3.0)]


def test_key_includes_gpu_metric_and_phase():
    base = latency()
    assert rec.record_key(base) != rec.record_key(latency(env={**ENV, "gpu": "NVIDIA H100"}))
    assert rec.record_key(base) != rec.record_key(latency(phase="decode"))
    assert rec.record_key(base) == rec.record_key(latency(7.0))  # the value is not the key


def test_load_records_from_a_folder_reads_every_jsonl(tmp_path):
    rec.upsert_records(tmp_path / "a.jsonl", [latency(1.0)])
    rec.upsert_records(tmp_path / "b.jsonl", [latency(2.0, provider="sdpa_cudnn")])
    (tmp_path / "notes.txt").write_text("not records")
    assert [r["provider"] for r in rec.load_records(tmp_path)] == ["sdpa_flash", "sdpa_cudnn"]


@pytest.mark.parametrize("change, message", [
    ({"phase": "train"}, "phase must be one of"),
    ({"p20": 2.0, "p50": 1.0}, "ordered"),
    ({"repeats": -1}, "repeats"),
    ({"p50": float("nan")}, "finite"),
    ({"kernel_names": "one string"}, "kernel_names"),
])
def test_invalid_records_are_refused(change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        latency(**change)


def test_missing_and_unknown_keys_are_named():
    record = latency()
    del record["gpu"]
    record["colour"] = "red"
    with pytest.raises(ValueError, match=r"missing \['gpu'\], unknown \['colour'\]"):
        rec.validate_record(record)


def test_skipped_rows_need_a_reason_and_only_they_have_one():
    with pytest.raises(ValueError, match="reason"):
        rec.make_record(kernel="call", provider="x", phase="prefill", shape=SHAPE,
                        metric=rec.SKIPPED, unit="reason", p20=None, p50=None, p80=None,
                        repeats=0, env=ENV)
    with pytest.raises(ValueError, match="only to metric='skipped'"):
        latency(reason="because")


def test_a_bad_line_is_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bench.jsonl"
    rec.upsert_records(path, [latency()])
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"bench.jsonl:2"):
        rec.load_records(path)
    with pytest.raises(ValueError, match="no records"):
        rec.load_records(tmp_path / "missing.jsonl")


def test_environment_on_this_machine(monkeypatch):
    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "0123456789ab")
    env = rec.environment("attnlab bench")
    assert set(env) == set(rec.ENVIRONMENT_KEYS) | set(rec.ENVIRONMENT_OPTIONAL_KEYS)
    assert env["git_commit"] == "0123456789ab"
    assert env["command"] == "attnlab bench"
    assert env["timestamp"].endswith("+00:00")
    import torch

    assert env["cuda_runtime"] == torch.version.cuda
    if not torch.cuda.is_available():
        assert env["gpu"] == "cpu" and env["driver"] is None and env["cudnn"] is None
    else:
        assert env["cudnn"].count(".") == 2  # major.minor.patch
    with pytest.raises(ValueError, match="command"):
        rec.environment("")


def test_versions_of_cuda_and_cudnn_travel_into_records_and_stay_optional():
    env = {**ENV, "cuda_runtime": "13.0", "cudnn": "9.10.2"}
    record = latency(env=env, timing_method="cuda-graph, flush=l2, warmup=3")
    assert record["cuda_runtime"] == "13.0" and record["cudnn"] == "9.10.2"
    assert record["timing_method"].startswith("cuda-graph")
    old = latency()  # an environment from before the keys existed
    assert "cudnn" not in old and "timing_method" not in old
    with pytest.raises(TypeError, match="cudnn"):
        rec.validate_record({**old, "cudnn": 91002})


def test_cudnn_version_numbers_are_decoded(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for number, text in ((91002, "9.10.2"), (90100, "9.1.0"), (8907, "8.9.7")):
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda n=number: n)
        assert rec.cudnn_version() == text


def test_every_write_keeps_a_tidy_csv_beside_the_jsonl(tmp_path):
    import csv

    path = tmp_path / "bench.jsonl"
    skipped = rec.skipped_record(provider="flash_attn", phase="prefill", shape=SHAPE,
                                 reason="flash_attn is not importable", env=ENV)
    rec.upsert_records(path, [latency(1.0), skipped])
    rec.upsert_records(path, [latency(4.0)])  # replaces the first row, in both files
    table = rec.csv_path(path)
    assert table.name == "bench.records.csv"
    with table.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(rec.CSV_COLUMNS)
    assert [(r["provider"], r["p50"]) for r in rows] == [("sdpa_flash", "4.0"), ("flash_attn", "")]
    assert rows[0]["seqlen_q"] == "4096" and rows[0]["window_left"] == "-1"
    assert rows[0]["kernel_names"] == "void pytorch_flash::flash_fwd_kernel<...>"
    assert rows[1]["reason"] == "flash_attn is not importable"
    assert all(r["command"] == ENV["command"] for r in rows)


def test_every_committed_records_file_has_its_csv_and_loads():
    folder = Path(__file__).resolve().parents[1] / "bench" / "results"
    files = sorted(folder.glob("*.jsonl"))
    assert files, f"no committed records under {folder}"
    for path in files:
        records = rec.load_records(path)
        assert records and rec.csv_path(path).is_file(), path
        # One row per record (a quoted field may hold a newline, e.g. a skip reason).
        with rec.csv_path(path).open(newline="") as handle:
            assert len(list(csv.reader(handle))) == len(records) + 1


def test_results_dir_is_the_shipped_folder_or_the_users(tmp_path):
    shipped = rec.committed_results()
    assert shipped.is_dir() and (shipped / "measure.jsonl").is_file()
    assert shipped.parent.parent.name == "attnlab"  # inside the package, not a checkout path
    assert rec.results_dir() == shipped
    assert rec.results_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="--records .* does not exist"):
        rec.results_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="--results .* does not exist"):
        rec.results_dir(tmp_path / "missing", option="--results")
