"""The serving example (examples/serving): a router and replicas as real processes over gloo.

Answers are checked against the model run in the test, request by request (the router's
trace names the class each answer picks for each image); a replica killed mid-stream costs no
request and answers none twice, whether its world is dropped (--rank) or rebuilt at a new
epoch by `multiworld run`, whose router then uses it again."""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tests.support.examples_harness import EXAMPLES, ExampleProcess, example_script, finish, free_base_port, load_example_module

from multiworld import WorldAssignment

SERVING = EXAMPLES / "serving"
model = load_example_module(SERVING / "model.py", "serving_model")
serving = load_example_module(SERVING / "main.py", "serving_main")

SEED = 7  # not the default: the router and the replicas must all take it from the flag


def events(trace: Path, kind: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    return [event for event in lines if event["event"] == kind]


def assert_each_request_answered_once(trace: Path, requests: int) -> list[dict[str, Any]]:
    answers = events(trace, "answer")
    counts = Counter(answer["id"] for answer in answers)
    assert sorted(counts) == list(range(requests)), f"unanswered: {sorted(set(range(requests)) - set(counts))}"
    assert max(counts.values()) == 1, [request for request, n in counts.items() if n > 1]
    return answers


def summary(process: ExampleProcess) -> str:
    return next(line for line in process.lines if line.startswith("summary: "))


def start_by_rank(flags: list[str], replicas: int = 2) -> dict[str, ExampleProcess]:
    """The router and `replicas` replicas, each given its --rank."""
    common = ["--backend", "gloo", "--port", str(free_base_port(replicas)), "--num_workers", str(replicas),
              "--seed", str(SEED)]  # fmt: skip
    processes = {
        f"replica{k}": ExampleProcess(f"replica{k}", [example_script("serving"), "--rank", str(k), *common])
        for k in range(1, replicas + 1)
    }
    processes["router"] = ExampleProcess("router", [example_script("serving"), "--rank", "0", *common, *flags])
    return processes


def test_the_model_and_the_requests_are_fixed_by_the_seed() -> None:
    first, again, other = model.build_model(SEED), model.build_model(SEED), model.build_model(SEED + 1)
    weights = first.state_dict()
    assert all(torch.equal(weights[key], value) for key, value in again.state_dict().items())
    assert not torch.equal(weights["classifier.weight"], other.state_dict()["classifier.weight"])
    images = model.request_batch(SEED, 3)
    assert images.shape == (model.BATCH, *model.IMAGE)
    assert torch.equal(images, model.request_batch(SEED, 3))
    assert not torch.equal(images, model.request_batch(SEED, 4))
    logits = model.infer(first, images)
    assert logits.shape == (model.BATCH, model.CLASSES) and bool(torch.isfinite(logits).all())
    # A real network: different images get different answers, and not one class for all.
    assert len({tuple(row.tolist()) for row in logits}) == model.BATCH
    classes = {int(c) for r in range(4) for c in model.infer(first, model.request_batch(SEED, r)).argmax(dim=1)}
    assert len(classes) > 1


def test_every_answer_is_the_models_answer_to_its_request(tmp_path: Path) -> None:
    requests, trace = 40, tmp_path / "trace.jsonl"
    processes = start_by_rank(["--requests", str(requests), "--rate", "0", "--check-every", "1", "--trace", str(trace)])
    codes = finish(processes)
    assert codes == dict.fromkeys(processes, 0), {n: p.output() for n, p in processes.items()}
    router = processes["router"]
    assert summary(router).startswith(f"summary: served {requests} of {requests} requests"), router.output()
    assert f"  checked {requests} answers against the model run here: 0 wrong" in router.lines, router.output()
    answers = assert_each_request_answered_once(trace, requests)
    served = model.build_model(SEED)
    for answer in answers:
        expected = model.infer(served, model.request_batch(SEED, answer["id"])).argmax(dim=1).tolist()
        assert answer["classes"] == expected, answer
    # Both replicas served: the router spreads the requests.
    assert {answer["world"] for answer in answers} == {"world1", "world2"}
    for name in ("replica1", "replica2"):
        last = processes[name].lines[-1]
        assert last == f"replica of world{name[-1]} stopped by the router", processes[name].output()


def test_a_replica_killed_mid_stream_loses_no_request(tmp_path: Path) -> None:
    requests, trace = 800, tmp_path / "trace.jsonl"
    processes = start_by_rank(["--requests", str(requests), "--rate", "0", "--trace", str(trace)])
    try:
        router = processes["router"]
        router.wait_for_line_starting("router: ")  # the stream starts: every request is there at once
        time.sleep(0.3)  # a few dozen answered (hundreds on a fast machine), each replica holding two
        processes["replica2"].kill()
    finally:
        codes = finish(processes)
    assert codes["router"] == 0 and codes["replica1"] == 0, router.output()
    assert [line for line in router.lines if line.startswith("world2 broke: ")], router.output()
    assert "world2 dropped: its replica serves no more" in router.lines, router.output()
    answers = assert_each_request_answered_once(trace, requests)
    (broke,) = events(trace, "broke")
    # What world2 held when it died went to world1, which alone answered from then on.
    retried = [answer for answer in answers if answer["attempts"] > 1]
    assert broke["resent"] >= 1 and len(retried) == broke["resent"], router.output()
    assert all(answer["world"] == "world1" for answer in retried)
    assert all(answer["world"] == "world1" for answer in answers if answer["sent"] > broke["at"])
    assert f"retried {broke['resent']}, lost 0, duplicates 0" in summary(router), router.output()


def local_manifest(tmp_path: Path, flags: list[str]) -> Path:
    """examples/serving/multiworld.yaml with the router's flags replaced, under a name of this
    test's own."""
    doc = yaml.safe_load((SERVING / "multiworld.yaml").read_text())
    doc["metadata"]["name"] = f"serving-{zlib.crc32(str(tmp_path).encode()):08x}"
    doc["spec"]["template"]["spec"]["containers"][0]["args"] = flags
    path = tmp_path / "multiworld.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_through_multiworld_run_a_killed_replica_comes_back_and_serves_again(tmp_path: Path) -> None:
    requests, rate, trace = 600, 40.0, tmp_path / "trace.jsonl"
    manifest = local_manifest(tmp_path, ["--requests", str(requests), "--rate", str(rate), "--seed", str(SEED),
                                         "--trace", str(trace)])  # fmt: skip
    run = ExampleProcess("multiworld run", ["-m", "multiworld_operator.cli", "run", str(manifest), "--json",
                                            "--no-view", "--spares", "replica1=1", "--log-dir", str(tmp_path / "logs"),
                                            "--kill", "replica1", "--after", "2"])  # fmt: skip
    assert run.wait() == 0, run.output()
    result = json.loads(next(line for line in reversed(run.lines) if line.startswith('{"worlds"')))
    assert result["orphans"] == 0
    assert result["worlds"]["world1"]["phase"] == "Succeeded" and result["worlds"]["world1"]["epoch"] == 2, result
    assert result["worlds"]["world2"]["failures"] == 0 and result["worlds"]["world2"]["errors"] == 0, result
    router_log = (tmp_path / "logs" / f"{manifest_name(manifest)}-router-0.log").read_text()
    assert "world1 back at epoch 2" in router_log, router_log
    answers = assert_each_request_answered_once(trace, requests)
    (start,), (back,) = events(trace, "start"), events(trace, "back")
    # The router uses the rebuilt world for the requests still to come, if any came a second
    # after it was back (on a machine slow enough, the stream may be over by then).
    if back["at"] + 1.0 < start["at"] + (requests - 1) / rate:
        assert any(a["world"] == "world1" and a["epoch"] == 2 for a in answers), router_log
    assert "lost 0, duplicates 0" in router_log and ": 0 wrong" in router_log, router_log


def manifest_name(manifest: Path) -> str:
    return yaml.safe_load(manifest.read_text())["metadata"]["name"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rank", "3"], "--rank: must be 0 (the router) or a replica in 1..2 (--num_workers 2), got 3"),
        (["--rank", "-1"], "--rank: must be >= 0"),
        (["--rank", "0", "--num_workers", "0"], "--num_workers: must be >= 1"),
        (["--rank", "0", "--requests", "0"], "--requests: must be >= 1"),
        (["--rank", "0", "--rate", "-5"], "--rate: must be >= 0"),
        (["--rank", "0", "--rate", "fast"], "--rate: invalid float value: 'fast'"),
        (["--rank", "0", "--check-every", "0"], "--check-every: must be >= 1"),
        (["--rank", "0", "--seed", "-1"], "--seed: must be in 0..2**32-1, got -1"),
        (["--rank", "0", "--seed", "x"], "--seed: expected an integer, got 'x'"),
        (["--rank", "0", "--port", "65534"], "--port 65534 + --num_workers 2 is not a TCP port"),
        (["--rank", "0", "--trace", "/nonexistent/dir/trace.jsonl"], "--trace: cannot write /nonexistent/dir"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = serving.build_parser()
    with pytest.raises(SystemExit) as exited:
        args = parser.parse_args(argv)
        serving.checked_trace(args, parser)
        serving.assignments_from_rank(args, parser)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_process_that_is_neither_router_nor_replica_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    world = WorldAssignment(name="world1", rank=2, size=3, host="127.0.0.1", port=29501)
    with pytest.raises(SystemExit) as exited:
        serving.is_router([world], serving.build_parser())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "MULTIWORLD_WORLDS: a serving process is the router" in err and "'world1': (2, 3)" in err
