#!/usr/bin/env python3
"""Validates rendered kustomize overlays (YAML streams from `kubectl kustomize`).

For each file: every built-in object against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail), ServiceMonitor and PrometheusRule against deploy/schemas/ (JSON
schemas written from the Prometheus Operator CRDs, jsonschema), and kvsparse's own rules:
  - every pod: non-root, seccomp RuntimeDefault; every container: no privilege escalation,
    read-only root filesystem, all capabilities dropped, grpc readiness/liveness probes on the
    port its --listen binds, cpu and memory requests = limits;
  - the flags in each container's --flagfile (a ConfigMap key) are flags of the server binary
    (`kvsparse-server --helpfull`), except PENDING_FLAGS, which the C++ side has yet to add;
  - memory limit >= --capacity (role all/store, unless the arena is on a memory volume charged
    to it anyway) + --resident_capacity (role all/worker) + 1Gi;
    terminationGracePeriodSeconds > --shutdown_grace; --gpu=on asks for nvidia.com/gpu;
    a memory-backed emptyDir holding --arena_file has room for one arena file of --capacity, two
    where a worker of the pod maps it (--store_arena_file: a restarted store's new file beside
    the old one);
    a worker's --store_arena_file is on such a volume, mounted read-only, that a container of
    the pod keeps its --arena_file on;
  - sharded stores: a StatefulSet's --shard_count equals its replicas and each pod's
    --shard_index is its ordinal (the pod-index label through the downward API); a worker's
    --store lists exactly that many shards, the StatefulSet's pods through its headless Service,
    in ordinal order;
  - every overlay has a NetworkPolicy; Prometheus Operator kinds only in a file rendered with the
    monitoring component (<overlay>+monitoring.yaml);
  - every Service and PodDisruptionBudget selects a pod template; every ServiceMonitor port is
    a port of some selected Service; the PrometheusRule's groups equal
    deploy/prometheus/kvsparse.rules.yml.

usage: validate_manifests.py --server BIN --k8s-version 1.30.0 rendered/*.yaml
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys

import importlib.util

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMAS = {
    "ServiceMonitor": ROOT / "deploy/schemas/servicemonitor-monitoring.coreos.com-v1.json",
    "PrometheusRule": ROOT / "deploy/schemas/prometheusrule-monitoring.coreos.com-v1.json",
}
RULES = ROOT / "deploy/prometheus/kvsparse.rules.yml"
# The shard-list syntax of the server's --store, from the Python package (loaded alone: the
# package's __init__ needs grpc, which this tool's environment does not have).
_spec = importlib.util.spec_from_file_location("placement", ROOT / "client/python/kvsparse/placement.py")
placement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(placement)
# Flags the manifests use that the server does not have yet (docs/DEPLOY.md, "Pending").
PENDING_FLAGS: set[str] = set()
GI = 1 << 30
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
         "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def parse_bytes(text):
    m = re.fullmatch(r"(\d+)([KMGT]i?)?B?", str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}")
    return int(m.group(1)) * UNITS[m.group(2) or ""]


def arena_file_bytes(capacity):
    """Size of the store's --arena_file for a --capacity (kvstore/shared_arena.cc), at most: a
    4 KiB header, 8 bytes of generation per granule (the page size, at least 4 KiB; rounded up
    to 4 KiB), the data."""
    granules = -(-capacity // 4096)
    return 4096 + -(-granules * 8 // 4096) * 4096 + granules * 4096


def parse_seconds(text):
    total, rest = 0.0, text
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text):
        total += float(value) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
        rest = rest.replace(value + unit, "", 1)
    if rest:
        raise ValueError(f"cannot parse duration {text!r}")
    return total


def server_flags(binary):
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z_0-9]+) \(", out, re.M))


class Checker:
    def __init__(self, name):
        self.name, self.errors = name, []

    def expect(self, cond, what):
        if not cond:
            self.errors.append(what)
        return cond


def container_flags(pod_spec, container, configmaps):
    """The flags a container gets: its args, with --flagfile expanded from the mounted ConfigMap."""
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    flags = {}
    for arg in container.get("args", []):
        m = re.fullmatch(r"--([a-z_0-9]+)=(.*)", arg)
        if not m:
            continue
        if m.group(1) == "flagfile":
            path = pathlib.PurePosixPath(m.group(2))
            cm = volumes[mounts[str(path.parent)]]["configMap"]["name"]
            for line in configmaps[cm]["data"][path.name].splitlines():
                fm = re.fullmatch(r"--([a-z_0-9]+)=(.*)", line.strip())
                if fm:
                    flags[fm.group(1)] = fm.group(2)
        else:
            flags[m.group(1)] = m.group(2)
    return flags


def check_workload(c, obj, configmaps, known_flags):
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    spec = obj["spec"]["template"]["spec"]
    psc = spec.get("securityContext", {})
    c.expect(psc.get("runAsNonRoot") is True, f"{where}: pod securityContext.runAsNonRoot")
    c.expect(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp RuntimeDefault")
    c.expect(spec.get("automountServiceAccountToken") is False, f"{where}: automountServiceAccountToken false")
    memory_volumes = {v["name"]: v["emptyDir"] for v in spec.get("volumes", [])
                      if v.get("emptyDir", {}).get("medium") == "Memory"}
    grace = spec.get("terminationGracePeriodSeconds", 30)
    for ct in spec["containers"]:
        w = f"{where}/{ct['name']}"
        sc = ct.get("securityContext", {})
        c.expect(sc.get("allowPrivilegeEscalation") is False, f"{w}: allowPrivilegeEscalation false")
        c.expect(sc.get("readOnlyRootFilesystem") is True, f"{w}: readOnlyRootFilesystem")
        c.expect(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{w}: capabilities drop ALL")
        c.expect(not sc.get("privileged"), f"{w}: not privileged")
        flags = container_flags(spec, ct, configmaps)
        unknown = set(flags) - known_flags - PENDING_FLAGS
        c.expect(not unknown, f"{w}: flags the server does not know: {sorted(unknown)}")
        for f in sorted(set(flags) & PENDING_FLAGS - known_flags):
            print(f"  PENDING {w}: --{f} is not a flag of this server yet (docs/DEPLOY.md)")
        port = int(flags.get("listen", "127.0.0.1:50051").rsplit(":", 1)[1])
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            p = ct.get(probe)
            if c.expect(p and "grpc" in p, f"{w}: {probe} is a grpc probe"):
                c.expect(p["grpc"]["port"] == port, f"{w}: {probe} port {p['grpc']['port']} != --listen port {port}")
        c.expect(port in [p["containerPort"] for p in ct.get("ports", [])], f"{w}: containerPort {port}")
        res = ct.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for r in ("cpu", "memory"):
            c.expect(r in lim and req.get(r) == lim.get(r), f"{w}: {r} requests = limits")
        role = flags.get("role", "all")
        need = GI
        arena_in_memory = "arena_file" in flags and any(
            flags["arena_file"].startswith(m["mountPath"].rstrip("/") + "/")
            for m in ct.get("volumeMounts", []) if m["name"] in memory_volumes)
        if role in ("all", "store"):
            need += parse_bytes(flags.get("capacity", "4G"))
        if role in ("all", "worker"):
            need += parse_bytes(flags.get("resident_capacity", "4G"))
        if "memory" in lim:
            c.expect(parse_bytes(lim["memory"]) >= need,
                     f"{w}: memory limit {lim['memory']} < flags' {need / GI:.0f}Gi")
        if arena_in_memory:
            # Room for two arena files where a worker of the pod maps it: a restarted store's
            # new one while the worker still maps the old one (kvstore/shared_arena.h).
            mapped = any("store_arena_file" in container_flags(spec, o, configmaps) for o in spec["containers"])
            want = (2 if mapped else 1) * arena_file_bytes(parse_bytes(flags.get("capacity", "4G")))
            for m in ct["volumeMounts"]:
                if m["name"] in memory_volumes and flags["arena_file"].startswith(m["mountPath"]):
                    size = memory_volumes[m["name"]].get("sizeLimit")
                    c.expect(size and parse_bytes(size) >= want,
                             f"{w}: arena volume sizeLimit {size} < {'two arena files' if mapped else 'the arena file'} ({want} bytes)")
        if "store_arena_file" in flags:
            c.expect(role == "worker", f"{w}: --store_arena_file without --role=worker")
            under = [m for m in ct.get("volumeMounts", [])
                     if flags["store_arena_file"].startswith(m["mountPath"].rstrip("/") + "/")]
            if c.expect(under and under[0]["name"] in memory_volumes,
                        f"{w}: --store_arena_file is not on a memory-backed volume"):
                c.expect(under[0].get("readOnly") is True, f"{w}: the arena volume is not read-only here")
                stores = [o for o in spec["containers"]
                          if container_flags(spec, o, configmaps).get("arena_file", "").startswith(
                              next(m["mountPath"] for m in o.get("volumeMounts", [])
                                   if m["name"] == under[0]["name"]) + "/")
                          if any(m["name"] == under[0]["name"] for m in o.get("volumeMounts", []))]
                c.expect(stores, f"{w}: no container of the pod keeps --arena_file on that volume")
        c.expect(grace > parse_seconds(flags.get("shutdown_grace", "10s")),
                 f"{w}: terminationGracePeriodSeconds {grace} <= --shutdown_grace {flags.get('shutdown_grace', '10s')}")
        if flags.get("gpu") == "on":
            c.expect(lim.get("nvidia.com/gpu") is not None, f"{w}: --gpu=on without an nvidia.com/gpu limit")
            c.expect(any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])),
                     f"{w}: --gpu=on without a nvidia.com/gpu toleration")
        if role == "worker":
            c.expect(flags.get("store"), f"{w}: --role=worker without --store")
        c.expect(":" in ct["image"] or "@" in ct["image"], f"{w}: image {ct['image']} has no tag")


def check_shards(c, workloads, configmaps):
    """Sharded stores and the workers' lists of them (see the module's docstring)."""
    shard_sets = {}  # StatefulSet name -> (replicas, headless service)
    for obj in workloads:
        spec = obj["spec"]["template"]["spec"]
        for ct in spec["containers"]:
            flags = container_flags(spec, ct, configmaps)
            count = int(flags.get("shard_count", "1"))
            if flags.get("role", "all") not in ("all", "store") or count <= 1:
                continue
            w = f"{obj['kind']}/{obj['metadata']['name']}/{ct['name']}"
            if not c.expect(obj["kind"] == "StatefulSet", f"{w}: --shard_count={count} outside a StatefulSet"):
                continue
            replicas = obj["spec"].get("replicas", 1)
            c.expect(replicas == count, f"{w}: --shard_count={count} but {replicas} replicas")
            env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in ct.get("env", [])}
            index = flags.get("shard_index", "")
            var = re.fullmatch(r"\$\((\w+)\)", index)
            c.expect(var and env.get(var.group(1)) == "metadata.labels['apps.kubernetes.io/pod-index']",
                     f"{w}: --shard_index={index!r} is not the pod's ordinal (the pod-index label)")
            shard_sets[obj["metadata"]["name"]] = (count, obj["spec"].get("serviceName"),
                                                   int(flags.get("listen", ":50051").rsplit(":", 1)[1]))
    for obj in workloads:
        spec = obj["spec"]["template"]["spec"]
        for ct in spec["containers"]:
            flags = container_flags(spec, ct, configmaps)
            if flags.get("role") != "worker" or not flags.get("store"):
                continue
            w = f"{obj['kind']}/{obj['metadata']['name']}/{ct['name']}"
            try:
                shards = placement.expand_shard_list(flags["store"])
            except ValueError as e:
                c.expect(False, f"{w}: --store: {e}")
                continue
            if len(shards) == 1 and not shard_sets:
                continue
            matched = False
            for name, (count, service, port) in shard_sets.items():
                want = [f"{name}-{i}.{service}:{port}" for i in range(count)]
                hosts = [a.split(".", 1)[0] for a in shards]
                if any(h.startswith(f"{name}-") for h in hosts):
                    matched = True
                    c.expect(shards == want, f"{w}: --store lists {shards}, the shards are {want}")
            c.expect(matched or len(shards) == 1, f"{w}: --store lists {len(shards)} shards of no sharded StatefulSet")


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--k8s-version", default="1.30.0")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    known_flags = server_flags(args.server)
    if len(known_flags) < 20:
        sys.exit(f"validate: {args.server} --helpfull listed only {len(known_flags)} flags")
    schemas = {k: json.loads(v.read_text()) for k, v in SCHEMAS.items()}
    rule_groups = yaml.safe_load(RULES.read_text())["groups"]
    failed = 0
    for file in args.files:
        docs = [d for d in yaml.safe_load_all(pathlib.Path(file).read_text()) if d]
        c = Checker(file)
        configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        templates = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        counts = {}
        for d in docs:
            kind, name = d["kind"], d["metadata"]["name"]
            counts[kind] = counts.get(kind, 0) + 1
            if kind in schemas:
                for e in jsonschema.Draft202012Validator(schemas[kind]).iter_errors(d):
                    c.errors.append(f"{kind}/{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
            else:
                try:
                    kubernetes_validate.validate(d, args.k8s_version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    c.errors.append(f"{kind}/{name}: {'/'.join(map(str, e.path))}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    c.errors.append(f"{kind}/{name}: no schema: {e}")
            if kind in ("Deployment", "StatefulSet"):
                check_workload(c, d, configmaps, known_flags)
            if kind in ("Service", "PodDisruptionBudget"):
                sel = d["spec"]["selector"] if kind == "Service" else d["spec"]["selector"]["matchLabels"]
                c.expect(any(selects(sel, t["spec"]["template"]["metadata"]["labels"]) for t in templates),
                         f"{kind}/{name}: selects no pod template")
            if kind == "PrometheusRule":
                c.expect(d["spec"]["groups"] == rule_groups,
                         f"PrometheusRule/{name}: groups differ from deploy/prometheus/kvsparse.rules.yml")
            if kind == "ServiceMonitor":
                services = [s for s in docs if s["kind"] == "Service"
                            and selects(d["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
                ports = {p["name"] for s in services for p in s["spec"]["ports"]}
                c.expect("metrics" in ports, f"ServiceMonitor/{name}: no selected Service has a metrics port")
                for s in services:
                    c.expect(s["spec"].get("clusterIP") == "None" or any(p["name"].startswith("metrics") for p in s["spec"]["ports"]),
                             f"Service/{s['metadata']['name']}: selected by the ServiceMonitor without a metrics port")
        check_shards(c, templates, configmaps)
        # An overlay as it is holds no Prometheus Operator kinds (it applies without their CRDs);
        # rendered with deploy/monitoring ("<overlay>+monitoring.yaml") it holds both.
        monitored = pathlib.Path(file).stem.endswith("+monitoring")
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "NetworkPolicy"):
            c.expect(kind in counts, f"no {kind}")
        for kind in ("ServiceMonitor", "PrometheusRule"):
            c.expect((kind in counts) == monitored,
                     f"{kind}: {'missing with' if monitored else 'present without'} the monitoring component")
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        if c.errors:
            failed += 1
            print(f"FAIL {file} ({summary}):")
            for e in c.errors:
                print(f"  - {e}")
        else:
            print(f"ok   {file}: {len(docs)} objects valid (Kubernetes {args.k8s_version} strict + CRD schemas + kvsparse rules): {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
