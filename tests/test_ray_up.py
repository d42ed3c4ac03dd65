"""`ray up` for real: two hosts, each a network namespace with its own PID namespace running
sshd, brought up with the shipped configs/ray/local.yaml (only the hosts, the SSH key and the
install command overridden). pdserve then runs with prefill on the head and decode on the other
host, so the KV crosses the virtual link; the text equals the engine's; `ray down` (plus `ray
stop` on the worker host, which `ray down` leaves running) ends with no processes left.

Needs root, iproute2, unshare, sshd and rsync (`.ci/run` installs the last two); skipped with
the reason elsewhere. Each host's /tmp/ray and home are its own (bind mounts in its mount
namespace), so its Ray cannot meet another's files, and `ray stop` sees only its own PID space."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pdcommon.client import RouterClient, make_request

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("ip", "unshare", "sshd", "rsync", "ssh", "ssh-keygen")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network and PID namespaces)"
    missing = [t for t in TOOLS if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install openssh-server rsync iproute2)"
    probe = f"pdprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"ray up test skipped: {WHY_NOT}")


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out


class Hosts:
    """N hosts on a bridge: namespace i has 10.<net>.0.i, the test runs on 10.<net>.0.254."""

    def __init__(self, base: Path, n: int = 2) -> None:
        self.base, self.tag = base, f"{os.getpid() % 10000}"
        self.net = random.randint(100, 250)
        self.ips = [f"10.{self.net}.0.{i + 1}" for i in range(n)]
        self.bridge = f"pdbr{self.tag}"
        self.names = [f"pdh{self.tag}x{i}" for i in range(n)]
        self.sshd: list[subprocess.Popen] = []
        self.key = base / "key"

    def start(self) -> None:
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point of each host's own /tmp/ray
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"10.{self.net}.0.254/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, (name, ip) in enumerate(zip(self.names, self.ips, strict=True)):
            self._host(i, name, ip)
        for ip in self.ips:
            self.wait_ssh(ip)

    def _host(self, i: int, name: str, ip: str) -> None:
        h = self.base / f"h{i}"
        (h / "home").mkdir(parents=True)
        (h / "ray").mkdir()
        shutil.copy(f"{self.key}.pub", h / "authorized_keys")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(h / "hostkey"))
        # root's home is this host's own (a passwd copy mounted over /etc/passwd in its mount
        # namespace): ray up writes its bootstrap files and .bashrc there, not in the real /root.
        passwd = re.sub(r"^(root:[^:]*:[^:]*:[^:]*:[^:]*:)[^:]*:", rf"\g<1>{h / 'home'}:",
                        Path("/etc/passwd").read_text(), flags=re.M)
        (h / "passwd").write_text(passwd)
        (h / "sshd_config").write_text(
            f"ListenAddress {ip}\nHostKey {h / 'hostkey'}\nPidFile {h / 'sshd.pid'}\n"
            f"PermitRootLogin prohibit-password\nAuthorizedKeysFile {h / 'authorized_keys'}\n"
            "PasswordAuthentication no\nUsePAM no\nStrictModes no\n")
        veth = f"pdv{self.tag}x{i}"
        sh("ip", "netns", "add", name)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        boot = (f"mount --bind {h / 'passwd'} /etc/passwd && mount --bind {h / 'ray'} /tmp/ray && "
                f"exec $(command -v sshd || echo /usr/sbin/sshd) -D -e -f {h / 'sshd_config'}")
        with open(h / "sshd.log", "wb") as log:
            # Its own PID namespace: sshd is its init, so killing it ends everything the host ran.
            # --kill-child: the namespace's init dies with unshare, even on SIGKILL (a death signal).
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--pid", "--mount", "--fork",
                                               "--kill-child", "--mount-proc", "sh", "-c", boot],
                                              stdout=log, stderr=subprocess.STDOUT))

    def ssh(self, ip: str, command: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-q", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o",
                               "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", f"root@{ip}",
                               f"bash -lc 'source ~/.bashrc; {command}'"], capture_output=True, text=True, **kw)

    def wait_ssh(self, ip: str, timeout_s: float = 20) -> None:
        end = time.monotonic() + timeout_s
        while self.ssh(ip, "true", timeout=10).returncode != 0:
            assert time.monotonic() < end, f"sshd on {ip} never answered"
            time.sleep(0.2)

    def processes(self, ip: str) -> list[str]:
        """What runs on the host but its sshd and this very ssh session."""
        out = self.ssh(ip, "ps -eo args=", timeout=30).stdout.splitlines()
        return [p for p in out if p and not p.startswith(("sshd", "bash -c", "ps -eo", "/usr/sbin/sshd"))]

    def stop(self) -> None:
        for p in self.sshd:
            p.kill()
            p.wait(10)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def leftovers(self, timeout_s: float = 10) -> list[str]:
        """Processes anywhere on the machine still running from this test's hosts."""
        end = time.monotonic() + timeout_s
        while True:
            found = subprocess.run(["pgrep", "-af", str(self.base)], capture_output=True, text=True).stdout.split("\n")
            found = [f for f in found if f and "pgrep" not in f]
            if not found or time.monotonic() > end:
                return found
            time.sleep(0.2)


def cluster_yaml(hosts: Hosts, path: Path) -> Path:
    """The shipped local-provider YAML with only the hosts, the key and the install replaced (the
    hosts share this machine's filesystem: installing is putting this venv on PATH)."""
    cfg = yaml.safe_load((ROOT / "configs" / "ray" / "local.yaml").read_text())
    cfg["cluster_name"] = f"pdtest{hosts.tag}"
    cfg["provider"].update(head_ip=hosts.ips[0], worker_ips=hosts.ips[1:])
    cfg["min_workers"] = cfg["max_workers"] = len(hosts.ips) - 1
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(hosts.key)}
    cfg["file_mounts"] = {}
    cfg["setup_commands"] = [f"echo 'export PATH={Path(sys.executable).parent}:$PATH' >> ~/.bashrc"]
    path.write_text(yaml.safe_dump(cfg))
    return path


def pdserve_yaml(stories_path: str, tmp_path: Path) -> Path:
    """configs/ray/pdserve.yaml with the test's model and a cluster token file."""
    cfg = yaml.safe_load((ROOT / "configs" / "ray" / "pdserve.yaml").read_text())
    token = tmp_path / "cluster.token"
    token.write_text("ray-up-test-token-0123456789abcdef\n")
    token.chmod(0o600)
    cfg.update(model=stories_path, security={"mode": "token", "token_file": str(token)})
    cfg["engine"]["num_threads"] = 1
    # stories260K's prompts are all short: without this the decode host would prefill them
    # itself (router.local_prefill_max_tokens' default), and no KV would cross between the hosts.
    cfg.setdefault("router", {})["local_prefill_max_tokens"] = 0
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def hosts(tmp_path):
    h = Hosts(tmp_path)
    try:
        h.start()
        yield h
    finally:
        h.stop()
    assert h.leftovers() == [], "the hosts' processes outlived them"


def test_ray_up_two_hosts_prefill_and_decode_apart(hosts, tmp_path, stories_path):
    env = {**os.environ, "RAY_UP_enable_autoscaler_v2": "0"}
    ray = str(Path(sys.executable).parent / "ray")
    conf = cluster_yaml(hosts, tmp_path / "cluster.yaml")
    sh(ray, "up", "-y", "--no-config-cache", str(conf), env=env, timeout=300, cwd=tmp_path)
    head, worker = hosts.ips
    up = None
    try:
        pd = pdserve_yaml(stories_path, tmp_path)
        log = tmp_path / "pdserve-up.log"
        with open(log, "wb") as out:
            up = subprocess.Popen(["ssh", "-tt", "-q", "-i", str(hosts.key), "-o", "StrictHostKeyChecking=no", "-o",
                                   "UserKnownHostsFile=/dev/null", f"root@{head}",
                                   f"bash -lc 'source ~/.bashrc; cd {ROOT} && exec pdserve up --config {pd}'"],
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + 240  # the worker host joins through the head's autoscaler first
        while "press Ctrl-C" not in log.read_text(errors="replace"):
            assert up.poll() is None and time.monotonic() < end, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        router = re.search(r"router ready at grpc://(\S+)", text).group(1)
        placed = dict(re.findall(r"^\s+(prefill|decode)\s+\S+\s+on (\S+)", text, re.M))
        assert router.startswith(head + ":") and placed == {"prefill": head, "decode": worker}, text[-3000:]

        from engine import EngineConfig, LLMEngine, SamplingParams

        prompt = "Once upon a time"
        eng = LLMEngine(EngineConfig(model=stories_path))
        ids = eng.tokenize(prompt)
        want = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0]["token_ids"]
        with RouterClient(router) as client:
            got, final = [], None
            for msg in client.stream(make_request(prompt, max_tokens=40), timeout=120):
                got += list(msg.token_ids)
                final = msg if msg.finish_reason else final
        assert got == want
        assert final.decode_worker != final.prefill_worker and final.usage.kv_transfer_bytes > 0
    finally:
        if up is not None:
            hosts.ssh(head, "pkill -INT -f \"pdserve up\"", timeout=30)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
        sh(ray, "down", "-y", str(conf), env=env, timeout=180, cwd=tmp_path, check=False)
        hosts.ssh(worker, "ray stop --force", timeout=120)  # `ray down` leaves the worker hosts' Ray
        for leftover in Path("/tmp/ray").glob(f"cluster-pdtest{hosts.tag}.*"):  # ray up's own state files
            leftover.unlink()
    for ip in hosts.ips:
        end = time.monotonic() + 30
        while (left := hosts.processes(ip)) and time.monotonic() < end:
            time.sleep(1)
        assert left == [], f"{ip} still runs {left}"
    assert up.returncode is not None and up.returncode != -signal.SIGKILL
