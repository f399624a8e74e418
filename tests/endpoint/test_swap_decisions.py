"""Several models on one member's GPUs (swap): the pure decision (which model wakes, which sleeps for it), the
config's checks, and `hpcserve up` refusing a swap it cannot run (exit 2, one message, nothing started). End to
end with stand-in members: test_swap_standin.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, free_port, run_cli_here

from hpcserve.core.config import parse_config
from hpcserve.core.errors import ConfigError
from hpcserve.core.registry import list_names
from hpcserve.endpoint.control.decisions import ModelUse, decide_swap
from hpcserve.endpoint.control.members import member_config
from hpcserve.endpoint.control.status import swap_lines

NOW = 1_000.0


def awake(name: str, since: float = NOW - 60, last_used: float = NOW - 30, in_flight: int = 0) -> ModelUse:
    return ModelUse(name, True, 0, in_flight, since, last_used)


def asleep(name: str, waiting: int = 0, last_used: float = NOW - 300) -> ModelUse:
    return ModelUse(name, False, waiting, 0, None, last_used)


def test_nothing_happens_while_no_request_waits_for_a_sleeping_model():
    assert decide_swap([awake("llama"), asleep("qwen")], 1, 10, NOW).action == "none"


def test_a_request_for_the_sleeping_model_puts_the_idle_awake_one_to_sleep_and_wakes_it():
    decision = decide_swap([awake("llama"), asleep("qwen", waiting=3)], 1, 10, NOW)
    assert (decision.action, decision.sleep, decision.wake) == ("swap", "llama", "qwen")
    assert decision.reason.startswith("qwen: 3 request(s) waiting, asleep; llama least recently used")
    assert "awake 60 s (>= swap.min_awake_s 10 s)" in decision.reason


def test_with_room_on_the_gpus_the_model_wakes_without_another_sleeping():
    decision = decide_swap([awake("llama"), asleep("qwen", waiting=1), asleep("mistral")], 2, 10, NOW)
    assert (decision.action, decision.sleep, decision.wake) == ("wake", None, "qwen")
    assert "1 of swap.awake 2 awake" in decision.reason


def test_the_least_recently_used_awake_model_is_the_one_put_to_sleep():
    models = [awake("llama", last_used=NOW - 5), awake("mistral", last_used=NOW - 50), asleep("qwen", waiting=1)]
    assert decide_swap(models, 2, 10, NOW).sleep == "mistral"


def test_a_model_with_requests_in_flight_or_woken_lately_is_not_put_to_sleep():
    busy = decide_swap([awake("llama", in_flight=2), asleep("qwen", waiting=1)], 1, 10, NOW)
    assert busy.action == "hold" and "llama: 2 in flight" in busy.reason and busy.wake == "qwen"
    fresh = decide_swap([awake("llama", since=NOW - 4), asleep("qwen", waiting=1)], 1, 10, NOW)
    assert fresh.action == "hold" and "llama: awake 4 s" in fresh.reason and "swap.min_awake_s 10" in fresh.reason
    # the busy one is passed over for an idle one
    models = [awake("llama", in_flight=1, last_used=NOW - 500), awake("mistral"), asleep("qwen", waiting=1)]
    assert decide_swap(models, 2, 10, NOW).sleep == "mistral"


def test_the_model_with_most_requests_waiting_wakes_first():
    models = [awake("llama"), asleep("qwen", waiting=1), asleep("mistral", waiting=4)]
    assert decide_swap(models, 1, 10, NOW).wake == "mistral"


# ---------------------------------------------------------------- the config

RAW = {"name": "sw", "model": {"path": "builtin:tiny-llama", "served_name": "llama"},
       "cluster": {"scheduler": "slurm", "gpus_per_node": 1},
       "swap": {"models": [{"path": "/models/qwen", "served_name": "qwen"}]}}


def config(**changes):
    return parse_config({**RAW, **changes})


def test_swap_starts_the_engines_in_sleep_mode_and_gives_each_model_a_port_of_the_member():
    cfg = config()
    assert cfg.engine_sleeps and cfg.swap is not None and cfg.swap.awake == 1
    member = member_config(cfg, "sw-m0", 1, cfg.parallelism, Path("/r"))  # type: ignore[arg-type]
    assert member.engine.sleep_mode == "on" and member.swap == cfg.swap
    assert member.swap_ports() == [member.serve.port + 1]  # its replica on serve.port, within its slot's ports
    two_replicas = config(parallelism={"tensor": 1, "pipeline": 1, "replicas": 2}, cluster={"scheduler": "slurm", "gpus_per_node": 2},
                   swap={"models": [{"path": "/m/q", "served_name": "q"}, {"path": "/m/r", "served_name": "r"}]})
    port = two_replicas.serve.port
    assert [two_replicas.swap_ports(0), two_replicas.swap_ports(1)] == [[port + 2, port + 3], [port + 4, port + 5]]  # none shared


@pytest.mark.parametrize(("changes", "says"), [
    ({"cluster": {"scheduler": "slurm", "gpus_per_node": 0}}, "which needs GPU engines"),
    ({"engine": {"sleep_mode": "off"}}, "which needs GPU engines"),
    ({"swap": {"models": [{"path": "/m/q", "served_name": "llama"}]}}, "the served name 'llama' is there twice"),
    ({"swap": {"models": [{"path": "/m/q"}], "awake": 2}}, "nothing would sleep"),
    ({"autoscale": {"min": 1}}, "autoscale (and scale to zero) of swapped models is not supported yet"),
    ({"serve": {"join": "other"}}, "remove serve.join"),
    ({"engine": {"executor": "ray"}}, "vLLM's Ray executor reserves them for one"),
])
def test_a_swap_that_cannot_work_is_refused_naming_the_fix(changes, says):
    with pytest.raises(ConfigError) as refused:
        config(**changes)
    assert says in str(refused.value)


def test_up_refuses_swap_on_cpu_engines_before_starting_anything(tmp_path, hpcserve_home):
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    data.update(name="sw-cpu", results_dir=str(tmp_path / "results"),
                swap={"models": [{"path": "builtin:tiny-llama", "served_name": "qwen"}]})
    data["serve"] = {**data["serve"], "port": free_port()}
    path = tmp_path / "swap.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run_cli_here("up", str(path))
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, said
    assert "swap puts models to sleep on the GPUs they share (vLLM's sleep mode), which needs GPU engines" in said
    assert said.startswith("error: ") and said.count("error") == 1 and "Traceback" not in said  # one message
    assert "sw-cpu" not in list_names() and not (tmp_path / "results").exists()


def test_status_says_which_model_is_awake_on_which_member():
    lines = swap_lines({"sw-m1": {"awake": [], "asleep": ["llama", "qwen"], "swapping": {"wake": "qwen",
                                                                                          "sleep": "llama"}},
                        "sw-m0": {"awake": ["qwen"], "asleep": ["llama"]}})
    assert lines == ["sw-m0 awake qwen (asleep: llama)",
                     "sw-m1 awake none (asleep: llama, qwen); swapping: llama to sleep, qwen waking"]
