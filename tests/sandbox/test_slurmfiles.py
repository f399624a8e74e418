"""The sandbox's Slurm files are a pure function of its settings (no root, no Slurm needed)."""

from __future__ import annotations

from hpcserve.sandbox.cluster import Sandbox
from hpcserve.sandbox.slurmfiles import (
    SETTINGS_FILE,
    gres_conf,
    hosts_file,
    nsswitch_files_only,
    render_files,
    slurm_conf,
)


def test_slurm_conf_names_every_node_with_its_address_and_gpus():
    sb = Sandbox(root="/srv/sb", nodes=2, prefix="ab", net="198.18.7", gpus_per_node=2)
    conf = slurm_conf(sb)
    assert "SlurmctldHost=abctl(198.18.7.10)" in conf
    assert "NodeName=abn1 NodeAddr=198.18.7.11 CPUs=4 RealMemory=4000 Gres=gpu:2 State=UNKNOWN" in conf
    assert "NodeName=abn2 NodeAddr=198.18.7.12" in conf and "abn3" not in conf
    assert "StateSaveLocation=/srv/sb/state/ctld" in conf
    assert gres_conf(sb) == "AutoDetect=off\nNodeName=abn1,abn2 Name=gpu File=/srv/sb/dev/gpu[0-1]\n"


def test_no_gpus_means_no_gres():
    sb = Sandbox(nodes=1, gpus_per_node=0)
    assert "Gres=" not in slurm_conf(sb)
    assert gres_conf(sb) == "AutoDetect=off\n"


def test_hosts_file_and_name_service_stay_inside_the_sandbox():
    sb = Sandbox(nodes=1)
    assert hosts_file(sb) == ("127.0.0.1 localhost\n198.18.0.1 hslogin\n198.18.0.10 hsctl\n"
                              "198.18.0.11 hsn1\n")
    assert nsswitch_files_only("passwd: files\nhosts: files dns\n") == "passwd: files\nhosts: files\n"


def test_render_files_writes_the_settings_last():
    files = render_files(Sandbox(nodes=1), nsswitch="")
    assert list(files)[-1] == SETTINGS_FILE  # it marks a complete build
    assert {"slurm.conf", "gres.conf", "cgroup.conf", "hosts", "resolv.conf"} <= set(files)


def test_high_partition_preempts_scavenger_and_the_default_partition_is_never_preempted():
    conf = slurm_conf(Sandbox(nodes=1))
    assert {"PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "SlurmctldParameters=preempt_send_user_signal"} <= set(conf.splitlines())
    parts = {}
    for line in conf.splitlines():
        if line.startswith("PartitionName="):
            name, *options = line.split()
            parts[name.split("=", 1)[1]] = dict(option.split("=", 1) for option in options)
    assert [name for name, o in parts.items() if o.get("Default") == "YES"] == ["debug"]
    assert {o["Nodes"] for o in parts.values()} == {"ALL"}
    tier = {name: int(o["PriorityTier"]) for name, o in parts.items()}
    assert tier["high"] > tier["debug"] > tier["scavenger"]
    assert parts["debug"]["PreemptMode"] == parts["high"]["PreemptMode"] == "OFF"
    assert parts["scavenger"]["PreemptMode"] == "REQUEUE" and int(parts["scavenger"]["GraceTime"]) > 0
