//! `deploy/grafana/siesta.json` is a well-formed Grafana dashboard and every
//! query names a metric that the binaries really export: checked against
//! the live `/metrics` of siesta-control (web listener) and siesta-proxy
//! (admin listener) after a request woke a model through the proxy.

use siesta_tests::ctl as util;
use siesta_tests::web as stack;

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use util::fake_model;

/// Families a short test cannot make appear (prometheus-client exports a
/// family only once it has a sample): each is checked against the source
/// that registers it instead. `upstream_connect_failures` needs an engine
/// that refuses connections while the control plane believes it awake;
/// `watch_lost` a Watch stream that ended.
const RARE: &[(&str, &str, &str)] = &[
    (
        "siesta_proxy_upstream_connect_failures",
        "counter",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy/src/metrics.rs"),
    ),
    (
        "siesta_proxy_watch_lost",
        "counter",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy/src/metrics.rs"),
    ),
];

/// A model on a hand-listed GPU (so GPU and engine memory series exist),
/// and one that is shed: it wakes slower than its hold limit.
fn models() -> String {
    format!(
        r#"
[[gpu]]
index = 0
name = "test-gpu"
memory = "80GiB"

[[model]]
name = "tiny"
model = "fake/tiny"
executable = "@FAKE_VLLM@"
gpus = 1
gpu_memory = 0.5
preload = "none"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
{}"#,
        fake_model(
            "slow",
            "asleep",
            &["--wake-time", "5s"],
            r#"max_hold = "300ms""#
        )
    )
}

fn dashboard() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/siesta.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON: {e}"))
}

/// `# TYPE name kind` lines of an exposition.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, k)| (n.to_string(), k.trim().to_string()))
        .collect()
}

/// The family a sample name belongs to, if exported.
fn family_of<'a>(name: &str, fams: &'a BTreeMap<String, String>) -> Option<&'a str> {
    if fams.get(name).is_some_and(|k| k == "gauge") {
        return fams.get_key_value(name).map(|(k, _)| k.as_str());
    }
    let suffixes: &[(&str, &str)] = &[
        ("_total", "counter"),
        ("_bucket", "histogram"),
        ("_sum", "histogram"),
        ("_count", "histogram"),
    ];
    suffixes.iter().find_map(|(suffix, kind)| {
        let base = name.strip_suffix(suffix)?;
        fams.get_key_value(base)
            .filter(|(_, k)| k.as_str() == *kind)
            .map(|(k, _)| k.as_str())
    })
}

/// Metric names (`siesta_...`) in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("siesta_") {
        let start = i + pos;
        let boundary =
            start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.push(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Every panel, rows' nested panels included.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels is an array") {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

#[test]
fn the_dashboard_is_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "siesta");
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        vars.contains(&"datasource") && vars.contains(&"model"),
        "{vars:?}"
    );
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or("?");
        let id = p["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("panel {title:?} has no id"));
        assert!(ids.insert(id), "panel id {id} ({title:?}) used twice");
        let g = &p["gridPos"];
        for k in ["h", "w", "x", "y"] {
            assert!(g[k].is_u64(), "panel {title:?}: gridPos.{k} missing");
        }
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "panel {title:?} is wider than the grid"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {title:?}: datasource"
        );
        let targets = p["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {title:?} has no targets"));
        assert!(!targets.is_empty(), "panel {title:?} has no queries");
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            assert!(
                !metric_names(expr).is_empty(),
                "panel {title:?}: {expr} names no siesta metric"
            );
            assert_eq!(
                expr.matches('(').count(),
                expr.matches(')').count(),
                "panel {title:?}: unbalanced parentheses in {expr}"
            );
            queries += 1;
        }
    }
    assert!(queries >= 15, "only {queries} queries");
}

#[tokio::test]
async fn every_query_names_a_metric_the_binaries_export() {
    let s = stack::stack(&models()).await;
    // A request through the proxy starts the model: held, woken, forwarded.
    s.ask("tiny").await;
    // One held past its limit is shed.
    let mut c = s.ctl.client().await;
    util::wait_state(
        &mut c,
        "slow",
        siesta_proto::v1::ModelState::Asleep,
        util::LONG,
    )
    .await;
    let shed = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.proxy.url()))
        .json(
            &serde_json::json!({"model": "slow", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .expect("request for slow");
    assert_eq!(shed.status(), 503, "slow is shed");
    let control = s.get("/metrics").await;
    let proxy = reqwest::get(format!("{}/metrics", s.proxy.admin_url()))
        .await
        .expect("proxy /metrics")
        .text()
        .await
        .expect("proxy /metrics body");
    let mut fams = families(&control);
    let proxy_fams = families(&proxy);
    assert!(
        !fams.is_empty(),
        "siesta-control /metrics has no families:\n{control}"
    );
    assert!(
        !proxy_fams.is_empty(),
        "siesta-proxy /metrics has no families:\n{proxy}"
    );
    fams.extend(proxy_fams);
    for (name, kind, source) in RARE {
        let text = std::fs::read_to_string(source).unwrap_or_else(|e| panic!("{source}: {e}"));
        let short = name.trim_start_matches("siesta_proxy_");
        assert!(
            text.contains(&format!("\"{short}\"")),
            "{source} no longer registers {name}"
        );
        fams.entry(name.to_string())
            .or_insert_with(|| kind.to_string());
    }

    // The metrics move with what happened.
    for needle in [
        "siesta_control_model_state{model=\"tiny\",state=\"awake\"} 1",
        "siesta_control_wakes_total{model=\"tiny\",from=\"stopped\"} 1",
        "siesta_control_wake_duration_seconds_count{model=\"tiny\",from=\"stopped\"} 1",
        "siesta_control_gpu_memory_total_bytes{gpu=\"0\"} 85899345920",
        "siesta_control_engine_gpu_memory_bytes{model=\"tiny\",gpu=\"0\"}",
    ] {
        assert!(
            control.contains(needle),
            "control /metrics lacks {needle}:\n{control}"
        );
    }
    for needle in [
        "siesta_proxy_requests_total{model=\"tiny\",status=\"200\"} 1",
        "siesta_proxy_hold_wait_seconds_count{model=\"tiny\"} 1",
        "siesta_proxy_shed_total{model=\"slow\",",
    ] {
        assert!(
            proxy.contains(needle),
            "proxy /metrics lacks {needle}:\n{proxy}"
        );
    }

    let d = dashboard();
    let mut used = BTreeSet::new();
    for p in panels(&d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            for name in metric_names(expr) {
                let fam = family_of(&name, &fams).unwrap_or_else(|| {
                    panic!(
                        "panel {:?}: {name} is not exported by siesta-control or siesta-proxy (exported: {:?})",
                        p["title"],
                        fams.keys().collect::<Vec<_>>()
                    )
                });
                used.insert(fam.to_string());
            }
        }
    }
    let unused: Vec<&String> = fams.keys().filter(|f| !used.contains(*f)).collect();
    assert!(unused.is_empty(), "exported but on no panel: {unused:?}");
}

#[test]
fn names_are_found_in_expressions() {
    assert_eq!(
        metric_names("rate(siesta_proxy_requests_total{a=\"x\"}[5m]) / siesta_control_x"),
        vec!["siesta_proxy_requests_total", "siesta_control_x"]
    );
    assert!(metric_names("rate(foo_siesta_bar[1m])").is_empty());
}
