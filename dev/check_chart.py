#!/usr/bin/env python3
"""Deployment checks: the Helm chart, the compose stack, the Dockerfiles, rust-version.

Run by ./dev/test after `cargo build --bins`. Offline except for PyPI: the first run
creates a virtualenv under .walcast-dev/ with helm-python-sdk (Helm's Go SDK as a
library: lint and template without a helm binary) and kubernetes-validate (the
Kubernetes OpenAPI schemas).

For the default values and each file in k8s/walcast/ci/:
  * the values against values.schema.json, `helm lint --strict` for each Kubernetes
    version, `helm template`;
  * every rendered object against the Kubernetes schemas of each version, strict (no
    unknown fields). ServiceMonitor and PrometheusRule (Prometheus Operator CRDs, not in
    those schemas) are checked against the small schemas below instead; any other kind
    without a schema is an error;
  * every env name of every walcast container is one the binary it runs accepts (parsed
    from `<binary> --help` of the freshly built binaries), plus the rules the chart
    promises (security context, probes, drain timing, memory from MAX_CONNECTIONS,
    pinned images, selectors that select something, Secret keys that exist).
Then the values the chart must refuse, the dashboard and alert rules (only metrics the
code records), docs/operations.md (every metric documented), docker-compose.yml and the
Dockerfiles (pinned bases, numeric user), and Cargo.toml's rust-version against the
locked dependencies.

Exit status 1 with every failure listed; 0 with a count of the checks passed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "k8s" / "walcast"
VENV = ROOT / ".walcast-dev" / "chart-venv"
REQUIREMENTS = ["helm-python-sdk==0.2.2", "kubernetes-validate==1.37.0", "PyYAML==6.0.4"]
# The chart's floor (Chart.yaml kubeVersion) and a recent release.
KUBE_VERSIONS = ["1.29.0", "1.35.0"]
WALCAST_UID = 10001
BINARIES = ("cdc-worker", "ws-front", "walcast")
# Env vars the chart sets for containers that are not walcast's (bundled NATS/Postgres).
THIRD_PARTY_CONTAINERS = {"nats", "postgresql"}


# --- bootstrap ------------------------------------------------------------------------

def ensure_venv() -> None:
    """Re-run this script inside .walcast-dev/chart-venv, creating it when needed."""
    if os.environ.get("WALCAST_CHART_VENV") == str(VENV):
        return
    stamp = VENV / "requirements.txt"
    python = VENV / "bin" / "python"
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if not python.exists() or not stamp.exists() or stamp.read_text() != wanted:
        print(f"chart check: installing {' '.join(REQUIREMENTS)} into {VENV.relative_to(ROOT)}")
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        except Exception as e:  # Debian without python3-venv: ensurepip is missing
            sys.exit(f"chart check: cannot create a virtualenv ({e}); install python3-venv")
        subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
        stamp.write_text(wanted)
    env = dict(os.environ, WALCAST_CHART_VENV=str(VENV))
    os.execve(str(python), [str(python), __file__, *sys.argv[1:]], env)


# --- results --------------------------------------------------------------------------

class Results:
    def __init__(self) -> None:
        self.passed = 0
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
        return ok

    def fail(self, what: str) -> None:
        self.failures.append(what)


R = Results()


# --- the binaries' environment variables -----------------------------------------------

ENV_IN_HELP = re.compile(r"\[env: ([A-Z][A-Z0-9_]*)(?:=[^\]]*)?\]")


def binary_env_names(bin_dir: Path) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for b in BINARIES:
        path = bin_dir / b
        if not path.exists():
            sys.exit(f"chart check: {path} is missing; run `cargo build --bins` first (or pass --bin-dir)")
        args = [str(path), "serve", "--help"] if b == "walcast" else [str(path), "--help"]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        names[b] = set(ENV_IN_HELP.findall(out))
        if not names[b]:
            sys.exit(f"chart check: no `[env: NAME]` in `{' '.join(args)}`")
    return names


# --- metric names the code records ---------------------------------------------------------

METRIC_NAME = re.compile(r"_(total|bytes|seconds|rows|active|detached|subscriptions|connections|channels|streams)$")


def code_metrics() -> set[str]:
    """Every `walcast_*` metric name in the crates (string literals and telemetry consts)."""
    found: set[str] = set()
    literal = re.compile(r'"(walcast_[a-z0-9_]+)"')
    for path in (ROOT / "crates").rglob("*.rs"):
        if "walcast-bench" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text()
        for name in literal.findall(text):
            # Metric names, not slot/bucket/table names that share the prefix.
            if METRIC_NAME.search(name):
                found.add(name)
    return found


HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def balanced(expr: str) -> bool:
    """(), [] and {} nest properly outside quoted strings: a cheap PromQL sanity check."""
    stack, quoted = [], False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "([{":
            stack.append(ch)
        elif not quoted and ch in ")]}":
            if not stack or "([{"[")]}".index(ch)] != stack.pop():
                return False
    return not stack and not quoted


def metrics_in_expr(expr: str) -> set[str]:
    return {HISTOGRAM_SUFFIX.sub("", m) for m in re.findall(r"\b(walcast_[a-z0-9_]+)", expr)}


# --- rendering and validation ---------------------------------------------------------------

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {}, "kind": {}, "metadata": {"type": "object", "required": ["name"]},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object"},
                    "namespaceSelector": {"type": "object", "additionalProperties": False,
                                          "properties": {"any": {"type": "boolean"},
                                                         "matchNames": {"type": "array", "items": {"type": "string"}}}},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                       "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                       "scheme": {"enum": ["http", "https"]},
                                       "authorization": {
                                           "type": "object", "additionalProperties": False, "required": ["credentials"],
                                           "properties": {
                                               "type": {"type": "string"},
                                               "credentials": {"type": "object", "additionalProperties": False,
                                                               "required": ["name", "key"],
                                                               "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                                                              "optional": {"type": "boolean"}}}}}}}},
                },
            },
        },
        "additionalProperties": False,
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {}, "kind": {}, "metadata": {"type": "object", "required": ["name"]},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["groups"],
                "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                    "properties": {"name": {"type": "string"}, "interval": {"type": "string"}, "rules": {
                        "type": "array", "minItems": 1, "items": {
                            "type": "object", "additionalProperties": False, "required": ["alert", "expr"],
                            "properties": {
                                "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$"},
                                "expr": {"type": "string", "minLength": 1},
                                "for": {"type": "string", "pattern": "^[0-9]+(s|m|h)$"},
                                "labels": {"type": "object", "additionalProperties": {"type": "string"},
                                           "required": ["severity"]},
                                "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                                                "required": ["summary", "description"]},
                            }}}}}}},
            },
        },
        "additionalProperties": False,
    },
}


def kube_validate(obj: dict, where: str) -> None:
    import jsonschema
    import kubernetes_validate.utils as kv

    key = (obj.get("apiVersion"), obj.get("kind"))
    for version in KUBE_VERSIONS:
        try:
            kv.validate(obj, version, strict=True)
            R.check(True, "")
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            R.fail(f"{where}: Kubernetes {version} schema (strict): {path}: {e.message}")
        except kv.SchemaNotFoundError:
            if key in CRD_SCHEMAS:
                errors = list(jsonschema.Draft7Validator(CRD_SCHEMAS[key]).iter_errors(obj))
                R.check(not errors, f"{where}: {key[1]} schema: {'; '.join(e.message for e in errors[:3])}")
            else:
                R.fail(f"{where}: no Kubernetes {version} schema for {key[1]} {key[0]} (unknown kind or API version)")


def split_docs(rendered: dict[str, str]) -> list[tuple[str, dict]]:
    import yaml

    docs = []
    for name, text in sorted(rendered.items()):
        if name.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append((name.split("/", 1)[1], doc))
    return docs


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def image_pinned(image: str) -> bool:
    name = image.split("@", 1)[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
    return bool(tag) and tag != "latest"


def check_walcast_container(c: dict, spec: dict, where: str, env_names: dict[str, set[str]]) -> dict[str, str]:
    """Rules for a container running one of our binaries; returns its plain env values."""
    command = c.get("command") or []
    binary = Path(command[0]).name if command else ""
    if not R.check(binary in BINARIES, f"{where}: command {command!r} does not run a walcast binary"):
        return {}
    R.check("envFrom" not in c, f"{where}: envFrom cannot be checked against the CLI; list env entries")
    accepted = env_names[binary]
    seen: set[str] = set()
    values: dict[str, str] = {}
    for e in c.get("env", []):
        name = e["name"]
        R.check(name in accepted, f"{where}: env {name} is not an option of {binary} (its --help lists no [env: {name}])")
        R.check(name not in seen, f"{where}: env {name} set twice")
        seen.add(name)
        if "value" in e:
            values[name] = e["value"]
    pod_sc = spec.get("securityContext", {})
    sc = c.get("securityContext", {})
    eff = lambda k: sc.get(k, pod_sc.get(k))  # noqa: E731
    R.check(eff("runAsNonRoot") is True, f"{where}: runAsNonRoot must be true")
    R.check(eff("runAsUser") == WALCAST_UID, f"{where}: runAsUser must be {WALCAST_UID}")
    R.check(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem must be true")
    R.check(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation must be false")
    R.check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: capabilities must drop ALL")
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
    R.check(seccomp.get("type") == "RuntimeDefault", f"{where}: seccompProfile must be RuntimeDefault")
    # A worker's startup probe asks /livez: a leader may stay unready for long for reasons
    # a restart does not fix (see worker-deployment.yaml).
    startup = "/livez" if binary == "cdc-worker" else "/readyz"
    for probe, path in (("startupProbe", startup), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        got = c.get(probe, {}).get("httpGet", {}).get("path")
        R.check(got == path, f"{where}: {probe} must GET {path} (got {got})")
    R.check("memory" in c.get("resources", {}).get("limits", {}), f"{where}: no memory limit")
    return values


def mebibytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)Mi", str(q))
    return int(m.group(1)) if m else -1


def check_rendered(label: str, values: dict, docs: list[tuple[str, dict]], env_names: dict[str, set[str]],
                   known_metrics: set[str]) -> None:
    by_kind: dict[str, list[dict]] = {}
    names_seen: set[tuple[str, str]] = set()
    for source, obj in docs:
        where = f"[{label}] {source} {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        R.check((obj["kind"], obj["metadata"]["name"]) not in names_seen, f"{where}: rendered twice")
        names_seen.add((obj["kind"], obj["metadata"]["name"]))
        by_kind.setdefault(obj["kind"], []).append(obj)
        kube_validate(obj, where)

    workloads = [o for k in ("Deployment", "StatefulSet") for o in by_kind.get(k, [])]
    secrets = {o["metadata"]["name"]: o for o in by_kind.get("Secret", [])}
    fullname = None
    for o in by_kind.get("Deployment", []):
        if o["metadata"]["name"].endswith("-ws-front"):
            fullname = o["metadata"]["name"][: -len("-ws-front")]
    R.check(fullname is not None, f"[{label}] no ws-front Deployment")
    R.check(any(o["metadata"]["name"].endswith("-cdc-worker") for o in by_kind.get("Deployment", [])),
            f"[{label}] no cdc-worker Deployment")
    existing = (values.get("secrets") or {}).get("existingSecret") or ""

    for o in workloads:
        spec = pod_spec(o)
        wname = f"[{label}] {o['kind']}/{o['metadata']['name']}"
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{wname} container {c['name']}"
            R.check(image_pinned(c["image"]), f"{where}: image {c['image']} is not pinned by a tag (no `latest`)")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if not ref:
                    continue
                R.check(ref["name"] in (existing or fullname, *secrets),
                        f"{where}: env {e['name']} reads Secret {ref['name']}, neither rendered nor secrets.existingSecret")
                if ref["name"] in secrets and not ref.get("optional"):
                    secret = secrets[ref["name"]]
                    R.check(ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})},
                            f"{where}: env {e['name']} reads key {ref['key']} missing from Secret {ref['name']}")
            if c["name"] in THIRD_PARTY_CONTAINERS:
                continue
            env = check_walcast_container(c, spec, where, env_names)
            binary = Path(c["command"][0]).name
            R.check(any(e["name"] == "METRICS_API_KEY" for e in c.get("env", [])),
                    f"{where}: no METRICS_API_KEY: nobody could read its /metrics")
            if binary == "ws-front":
                check_front(o, spec, c, env, where)
            if binary == "cdc-worker":
                lease = env.get("LEASE_MODE")
                R.check(lease in ("kubernetes", "postgres"), f"{where}: LEASE_MODE must be kubernetes or postgres, not {lease}")
                R.check(spec.get("automountServiceAccountToken") is (lease == "kubernetes"),
                        f"{where}: a service account token must be mounted exactly in Kubernetes lease mode")
                if lease == "kubernetes":
                    R.check(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", env.get("LEASE_NAME", "")) is not None,
                            f"{where}: Kubernetes lease mode needs LEASE_NAME set to a valid object name (got {env.get('LEASE_NAME')!r})")
                    R.check(any(r["kind"] == "Role" for r in by_kind.get("Role", [])), f"{where}: Kubernetes lease mode without a Role")
                else:
                    R.check(not by_kind.get("Role"), f"{where}: a Role rendered though the lease is not Kubernetes'")

    for sa in by_kind.get("ServiceAccount", []):
        if sa["metadata"]["name"].endswith("-ws-front"):
            R.check(sa.get("automountServiceAccountToken") is False, f"[{label}] the front's ServiceAccount must not mount a token")

    all_pods = [pod_labels(o) for o in workloads]
    for s in by_kind.get("Service", []):
        R.check(any(selects(s["spec"]["selector"], l) for l in all_pods),
                f"[{label}] Service/{s['metadata']['name']} selects no pod")
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for p in by_kind.get(kind, []):
            R.check(any(selects(p["spec"]["podSelector" if kind == "NetworkPolicy" else "selector"], l) for l in all_pods),
                    f"[{label}] {kind}/{p['metadata']['name']} selects no pod")
    for h in by_kind.get("HorizontalPodAutoscaler", []):
        target = h["spec"]["scaleTargetRef"]["name"]
        R.check(any(o["metadata"]["name"] == target for o in by_kind.get("Deployment", [])),
                f"[{label}] HPA targets missing Deployment {target}")
        front = next(o for o in by_kind["Deployment"] if o["metadata"]["name"] == target)
        R.check("replicas" not in front["spec"], f"[{label}] an HPA-managed Deployment must not set replicas")
    for sm in by_kind.get("ServiceMonitor", []):
        R.check(any(selects(sm["spec"]["selector"], s["metadata"]["labels"]) for s in by_kind.get("Service", [])),
                f"[{label}] ServiceMonitor selects no Service")
        check_scrape_key(label, sm, secrets, existing or fullname)
    for ing in by_kind.get("Ingress", []):
        paths = [p["path"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
        R.check(not any("/metrics".startswith(p.rstrip("/") + "/") or p == "/" for p in paths),
                f"[{label}] the Ingress must not expose /metrics (paths {paths})")
    for rule in by_kind.get("PrometheusRule", []):
        for g in rule["spec"]["groups"]:
            for r in g["rules"]:
                R.check(balanced(r["expr"]), f"[{label}] alert {r['alert']}: unbalanced brackets in {r['expr']!r}")
                used = metrics_in_expr(r["expr"])
                R.check(used <= known_metrics, f"[{label}] alert {r['alert']} uses metrics the code does not record: {sorted(used - known_metrics)}")
    for cm in by_kind.get("ConfigMap", []):
        for key, text in cm.get("data", {}).items():
            if key.endswith(".json"):
                try:
                    json.loads(text)
                    R.check(True, "")
                except ValueError as e:
                    R.fail(f"[{label}] ConfigMap {cm['metadata']['name']} {key}: not JSON: {e}")


def check_scrape_key(label: str, sm: dict, secrets: dict[str, dict], secret_name: str | None) -> None:
    """/metrics answers the figures key only: every endpoint sends it, from a key of the
    release's Secret that the walcast containers read as METRICS_API_KEY."""
    for ep in sm["spec"]["endpoints"]:
        cred = ep.get("authorization", {}).get("credentials", {})
        if not R.check(bool(cred), f"[{label}] ServiceMonitor endpoint {ep.get('path')} sends no key (/metrics needs METRICS_API_KEY)"):
            continue
        R.check(cred.get("name") == secret_name, f"[{label}] ServiceMonitor reads Secret {cred.get('name')}, not the release's {secret_name}")
        if cred.get("name") in secrets:
            secret = secrets[cred["name"]]
            R.check(cred.get("key") in {**secret.get("data", {}), **secret.get("stringData", {})},
                    f"[{label}] ServiceMonitor reads key {cred.get('key')} missing from Secret {cred['name']}")


def check_front(deploy: dict, spec: dict, c: dict, env: dict[str, str], where: str) -> None:
    drain = int(env.get("DRAIN_SECS", "10"))
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    R.check(len(pre) == 2 and pre[0].endswith("sleep"), f"{where}: preStop must sleep (got {pre})")
    sleep = int(pre[1]) if len(pre) == 2 and pre[1].isdigit() else 0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    R.check(grace > sleep + drain, f"{where}: terminationGracePeriodSeconds {grace} must exceed preStop {sleep} s + DRAIN_SECS {drain} s")
    R.check(spec.get("automountServiceAccountToken") is False, f"{where}: the front needs no service account token")
    maxconn = int(env.get("MAX_CONNECTIONS", "0"))
    R.check(maxconn > 0, f"{where}: MAX_CONNECTIONS must be set (the memory is sized from it)")
    req = mebibytes(c["resources"].get("requests", {}).get("memory", ""))
    lim = mebibytes(c["resources"].get("limits", {}).get("memory", ""))
    # The chart's default sizing: at least 19 KB per joined connection (measured), limit above request.
    if req > 0:
        R.check(req * 1024 >= maxconn * 19, f"{where}: memory request {req}Mi is below 19 KiB x MAX_CONNECTIONS {maxconn}")
        R.check(lim >= req, f"{where}: memory limit {lim}Mi below the request {req}Mi")


def load_values(path: Path | None) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) if path else {}


def check_chart(env_names: dict[str, set[str]], known_metrics: set[str]) -> None:
    import helm_python as helm

    value_sets: list[tuple[str, Path | None, str]] = [("default", None, "walcast")]
    for f in sorted((CHART / "ci").glob("*.yaml")):
        value_sets.append((f.name, f, "rt"))
    R.check(len(value_sets) >= 3, "k8s/walcast/ci/ must hold at least two value sets")
    with helm.Chart.load(str(CHART)) as chart:
        for label, path, release in value_sets:
            values = load_values(path)
            try:
                chart.validate_schema(values)
                R.check(True, "")
            except helm.HelmError as e:
                R.fail(f"[{label}] values.schema.json: {e}")
                continue
            for version in KUBE_VERSIONS:
                report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{version}", namespace="walcast")
                bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2] + report.get("errors", [])
                R.check(not bad, f"[{label}] helm lint --strict (Kubernetes {version}): {bad}")
            try:
                rendered = chart.render(values, name=release, namespace="walcast")
            except helm.HelmError as e:
                R.fail(f"[{label}] helm template: {e}")
                continue
            notes = next((t for n, t in rendered.items() if n.endswith("NOTES.txt")), "")
            R.check("walcast" in notes, f"[{label}] NOTES.txt rendered empty")
            docs = split_docs(rendered)
            check_rendered(label, values, docs, env_names, known_metrics)

        # Values the chart must refuse, with the reason in the message.
        refused = [
            ({"image": {"tag": "latest"}}, "not"),
            ({"secrets": {"jwtSecret": "x"}}, "secrets.databaseUrl is required"),
            ({"secrets": {"jwtSecret": "x"}, "postgresql": {"enabled": True}}, "postgresPassword is required"),
            ({"secrets": {"databaseUrl": "postgres://u@h/d"}}, "secrets.jwtSecret is required"),
            ({"secrets": {"jwtSecret": "x", "databaseUrl": "postgres://u@h/d"}}, "secrets.checkDatabaseUrl is required"),
            ({"secrets": {"jwtSecret": "x", "databaseUrl": "postgres://u@h/d", "checkDatabaseUrl": "postgres://c@h/d"}}, "secrets.secretsKey is required"),
            ({"secrets": {"jwtSecret": "x", "postgresPassword": "p", "secretsKey": "k" * 32}, "postgresql": {"enabled": True}}, "checkPassword is required"),
            ({"secrets": {"secretsKey": "short"}}, "secretsKey"),
            ({"secrets": {"jwtSecret": "x", "databaseUrl": "postgres://u@h/d", "checkDatabaseUrl": "postgres://c@h/d", "secretsKey": "k" * 32},
              "metrics": {"serviceMonitor": {"enabled": True}}}, "secrets.metricsApiKey is required"),
            ({"nats": {"enabled": False}}, "anyOf"),
            ({"worker": {"lease": {"mode": "none"}}}, "kubernetes"),
            ({"postgresql": {"maxSlotWalKeepSize": "-1"}}, "maxSlotWalKeepSize"),
            ({"front": {"terminationGracePeriodSeconds": 12}}, "terminationGracePeriodSeconds must be longer"),
            ({"ingress": {"enabled": True}}, "ingress.hosts"),
            ({"frnt": {}}, "additional properties"),
        ]
        for values, expected in refused:
            try:
                chart.validate_schema(values)
                chart.render(values, name="walcast", namespace="walcast")
                R.fail(f"the chart accepted values it must refuse: {values}")
            except helm.HelmError as e:
                R.check(expected in str(e), f"refusing {values}: expected {expected!r} in {str(e)[:300]!r}")


def check_probe_routes() -> None:
    """The probes the chart points at are routes the binaries serve."""
    sources = "\n".join(p.read_text() for p in (ROOT / "crates").rglob("*.rs") if "walcast-bench" not in p.parts)
    for route in ("/livez", "/readyz"):
        R.check(f'"{route}"' in sources, f"the chart probes {route}, but no route \"{route}\" is in crates/")


def check_dashboard_and_docs(known_metrics: set[str]) -> None:
    dash = json.loads((CHART / "dashboards" / "walcast.json").read_text())
    used: set[str] = set()

    def walk(panels: list) -> None:
        for p in panels:
            for t in p.get("targets", []):
                used.update(metrics_in_expr(t.get("expr", "")))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    R.check(bool(used), "the dashboard queries no walcast metric")
    R.check(used <= known_metrics, f"the dashboard uses metrics the code does not record: {sorted(used - known_metrics)}")
    doc = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(m for m in known_metrics if m not in doc)
    R.check(not missing, f"docs/operations.md does not document: {missing}")
    documented = {HISTOGRAM_SUFFIX.sub("", m) for m in re.findall(r"`(walcast_[a-z0-9_]+)", doc)}
    documented = {m for m in documented if METRIC_NAME.search(m)}
    stale = sorted(documented - known_metrics)
    R.check(not stale, f"docs/operations.md documents metrics the code does not record: {stale}")
    for alert in re.findall(r"- alert: (\w+)", (CHART / "templates" / "prometheusrule.yaml").read_text()):
        R.check(alert in doc, f"docs/operations.md does not explain alert {alert}")


def check_compose(env_names: dict[str, set[str]]) -> None:
    import yaml

    path = ROOT / "docker-compose.yml"
    compose = yaml.safe_load(path.read_text())
    services = compose.get("services", {})
    for name in ("postgres", "nats", "cdc-worker", "ws-front"):
        R.check(name in services, f"docker-compose.yml: no service {name}")
    for name, svc in services.items():
        where = f"docker-compose.yml service {name}"
        R.check(isinstance(svc, dict) and ("image" in svc or "build" in svc), f"{where}: neither image nor build")
        if "image" in svc:
            R.check(image_pinned(svc["image"]), f"{where}: image {svc['image']} not pinned by a tag")
        build = svc.get("build")
        if build:
            ctx = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = ctx / "Dockerfile" if isinstance(build, str) else ROOT / build.get("dockerfile", "") if "dockerfile" in build else ctx / "Dockerfile"
            R.check(dockerfile.is_file(), f"{where}: no Dockerfile at {dockerfile}")
        for dep, how in (svc.get("depends_on") or {}).items():
            R.check(dep in services, f"{where}: depends on unknown service {dep}")
            R.check((how or {}).get("condition") == "service_healthy", f"{where}: must wait for {dep} to be healthy")
        entry = svc.get("entrypoint") or []
        binary = Path(entry[0]).name if entry else ""
        if binary in ("cdc-worker", "ws-front") or (binary == "walcast" and "serve" in (svc.get("command") or [])):
            test = (svc.get("healthcheck") or {}).get("test") or []
            R.check("probe" in test and any(Path(t).name == "walcast" for t in test),
                    f"{where}: a walcast server must be health-checked with `walcast probe`")
        if binary in BINARIES:
            env = svc.get("environment") or {}
            keys = env.keys() if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]
            for k in keys:
                R.check(k in env_names[binary], f"{where}: env {k} is not an option of {binary}")
    nats_cmd = services.get("nats", {}).get("command", [])
    R.check("-js" in nats_cmd or "--jetstream" in nats_cmd, "docker-compose.yml: NATS without JetStream (-js)")
    # One set of NATS permissions: the chart ships a copy (Helm reads only its own files).
    shipped = (ROOT / "docker" / "nats" / "walcast-permissions.conf").read_text()
    chart_copy = (ROOT / "k8s" / "walcast" / "files" / "walcast-permissions.conf").read_text()
    R.check(shipped == chart_copy, "k8s/walcast/files/walcast-permissions.conf differs from docker/nats/")


def check_dockerfiles() -> None:
    for path in (ROOT / "docker" / "Dockerfile", ROOT / "docker" / "postgres" / "Dockerfile"):
        text = path.read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
        for ref in re.findall(r"^FROM (\S+)", text, re.M):
            ref = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), ref)
            if "/" not in ref and ":" not in ref and "{" not in ref:
                continue  # a stage name
            R.check(image_pinned(ref) and re.search(r":\S*\d+\.\d+", ref) is not None,
                    f"{path.relative_to(ROOT)}: base image {ref} is not pinned to a specific version")
    main = (ROOT / "docker" / "Dockerfile").read_text()
    R.check(re.search(r"^USER 10001:10001$", main, re.M) is not None, "docker/Dockerfile: must run as USER 10001:10001")
    R.check(re.search(r'^HEALTHCHECK .*"/usr/local/bin/walcast", "probe"', main, re.M) is not None,
            "docker/Dockerfile: no HEALTHCHECK with walcast probe")
    version = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    R.check(re.search(rf"^ARG VERSION={re.escape(version)}$", main, re.M) is not None,
            f"docker/Dockerfile: ARG VERSION is not the workspace's version {version}")
    for label in ("title", "description", "version", "licenses"):
        R.check(f"org.opencontainers.image.{label}=" in main, f"docker/Dockerfile: no OCI label {label}")
    app_version = re.search(r'^appVersion: "([^"]+)"', (CHART / "Chart.yaml").read_text(), re.M).group(1)
    R.check(app_version == version, f"k8s/walcast/Chart.yaml: appVersion {app_version} is not the workspace's version {version}")
    R.check("ca-certificates" in main, "docker/Dockerfile: ca-certificates not installed")
    pg = (ROOT / "docker" / "postgres" / "Dockerfile").read_text() + (ROOT / "docker" / "postgres" / "postgresql.conf").read_text()
    R.check(re.search(r"wal2json=\$\{WAL2JSON_VERSION\}", pg) and re.search(r"^ARG WAL2JSON_VERSION=\d", pg, re.M) is not None,
            "docker/postgres: wal2json must be pinned by version")
    for setting in ("wal_level = logical", "max_replication_slots", "max_wal_senders", "max_slot_wal_keep_size"):
        R.check(setting in pg, f"docker/postgres/postgresql.conf: {setting} missing")
    R.check(re.search(r"max_slot_wal_keep_size = -1", pg) is None, "docker/postgres: max_slot_wal_keep_size must be bounded")
    ignore = (ROOT / ".dockerignore").read_text().split()
    for entry in ("target/", ".walcast-dev/", "tests/js/node_modules/", ".git"):
        R.check(entry in ignore, f".dockerignore: {entry} missing")


def version_tuple(v: str) -> tuple[int, ...]:
    parts = [int(x) for x in re.findall(r"\d+", v)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def check_rust_version() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["rust-version"]
    lock = tomllib.loads((ROOT / "Cargo.lock").read_text())
    cargo_home = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo"))
    sources = sorted((cargo_home / "registry" / "src").glob("*"))
    need: list[tuple[tuple[int, ...], str]] = []
    for pkg in lock["package"]:
        if "source" not in pkg:
            continue
        for src in sources:
            manifest = src / f"{pkg['name']}-{pkg['version']}" / "Cargo.toml"
            if manifest.exists():
                rv = tomllib.loads(manifest.read_text()).get("package", {}).get("rust-version")
                if isinstance(rv, str):
                    need.append((version_tuple(rv), f"{pkg['name']} {pkg['version']} needs {rv}"))
                break
    if not R.check(bool(need), "rust-version: no locked crate found in the cargo registry (run cargo fetch)"):
        return
    top = max(need)
    R.check(version_tuple(declared) >= top[0],
            f"Cargo.toml rust-version {declared} is below what the locked dependencies need ({top[1]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, default=ROOT / "target" / "debug",
                        help="where cdc-worker, ws-front and walcast were built (default: target/debug)")
    args = parser.parse_args()
    ensure_venv()
    import kubernetes_validate.utils as kv

    # The schema files are large: read each once.
    kv.schema_contents = functools.lru_cache(maxsize=None)(kv.schema_contents)
    print("== chart, images and compose (dev/check_chart.py)")
    env_names = binary_env_names(args.bin_dir)
    known = code_metrics()
    check_chart(env_names, known)
    check_probe_routes()
    check_dashboard_and_docs(known)
    check_compose(env_names)
    check_dockerfiles()
    check_rust_version()
    for f in R.failures:
        print(f"FAIL {f}")
    print(f"chart check: {R.passed} passed, {len(R.failures)} failed")
    sys.exit(1 if R.failures else 0)


if __name__ == "__main__":
    main()
