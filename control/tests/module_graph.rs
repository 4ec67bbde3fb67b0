//! The control crate's modules form no import circle: each top-level module
//! (`admission`, `runner`, `placement`, ...) only uses modules below it, so
//! a newcomer can read the crate bottom-up. Read from the `crate::` paths of
//! the non-test sources (test modules may reach across for fixtures).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "bin") {
                continue;
            }
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name.contains("test") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            // Inline test modules come last in a file.
            let text = text.split("#[cfg(test)]").next().unwrap_or("").to_string();
            let rel = p.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
            out.push((rel.to_string_lossy().into_owned(), text));
        }
    }
}

/// `src/runner/effects.rs` → `runner`.
fn top(rel: &str) -> String {
    let rest = rel.trim_start_matches("src/");
    rest.split('/')
        .next()
        .unwrap()
        .trim_end_matches(".rs")
        .to_string()
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in &files {
        let from = top(rel);
        for part in text.split("crate::").skip(1) {
            let to: String = part
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !to.is_empty() && to != from {
                g.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    g
}

/// A path from `a` back to `a`, if any.
fn cycle(g: &BTreeMap<String, BTreeSet<String>>, a: &str) -> Option<Vec<String>> {
    let mut stack = vec![(a.to_string(), vec![a.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((n, path)) = stack.pop() {
        for m in g.get(&n).into_iter().flatten() {
            if m == a {
                let mut p = path.clone();
                p.push(a.to_string());
                return Some(p);
            }
            if seen.insert(m.clone()) {
                let mut p = path.clone();
                p.push(m.clone());
                stack.push((m.clone(), p));
            }
        }
    }
    None
}

#[test]
fn control_modules_import_no_circle() {
    let g = graph();
    assert!(g.len() > 10, "read too little of the crate: {g:?}");
    for m in g.keys() {
        if let Some(c) = cycle(&g, m) {
            panic!("import circle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_check_sees_a_circle() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(cycle(&g, "a").unwrap(), ["a", "b", "a"]);
}
