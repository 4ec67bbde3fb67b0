//! [`place_config`]: a configuration's placement and its refusals, as the
//! daemon and `siesta config check` both see them.

use super::*;
use crate::config::Config;

const GIB: u64 = 1 << 30;

fn parse(models: &str) -> Config {
    let text = format!("[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n{models}");
    Config::parse(&text, "box.toml").unwrap()
}

fn model(name: &str, extra: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nmodel = \"m\"\n{extra}\n")
}

fn one_gpu() -> Machine {
    Machine::uniform(1, 80 * GIB)
}

#[test]
fn a_model_bigger_than_its_gpu_is_refused_naming_file_key_model_and_numbers() {
    let c = parse(&format!(
        "{}{}",
        model("ok", "gpu_memory = 0.5"),
        model("big", "gpu_memory = \"100GiB\"")
    ));
    let e = place_config(&c, &one_gpu(), &BTreeMap::new()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "box.toml: model[1].gpu_memory: model \"big\": needs 1 × 100.0 GiB but GPU 0 has 80.0 GiB"
    );
}

#[test]
fn more_gpus_than_the_box_has_is_refused_on_the_gpus_key() {
    let c = parse(&model("tp", "gpus = 2"));
    let e = place_config(&c, &one_gpu(), &BTreeMap::new()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "box.toml: model[0].gpus: model \"tp\": needs 2 GPUs but the box has 1 (0)"
    );
}

#[test]
fn no_inventory_is_not_a_refusal() {
    let c = parse(&model("a", "gpus = 1"));
    let planned = place_config(&c, &Machine::default(), &BTreeMap::new()).unwrap();
    assert_eq!(planned, Planned::NoInventory);
}

#[test]
fn a_reload_keeps_running_models_on_their_gpus_when_everything_fits() {
    let machine = Machine::uniform(2, 80 * GIB);
    let c = Config::parse(
        &format!(
            "{}{}",
            model("a", "gpu_memory = 0.5"),
            model("b", "gpu_memory = 0.3")
        ),
        "box.toml",
    )
    .unwrap();
    let fresh = match place_config(&c, &machine, &BTreeMap::new()).unwrap() {
        Planned::Placed(p) => p,
        other => panic!("{other:?}"),
    };
    let a_fresh = fresh.iter().find(|p| p.model == "a").unwrap().gpus.clone();
    // a runs on the other GPU: it stays there.
    let other = vec![1 - a_fresh[0]];
    let keep = BTreeMap::from([("a".to_string(), other.clone())]);
    let kept = match place_config(&c, &machine, &keep).unwrap() {
        Planned::Placed(p) => p,
        other => panic!("{other:?}"),
    };
    let a = kept.iter().find(|p| p.model == "a").unwrap();
    assert_eq!(a.gpus, other);
    assert!(a.reason.contains("(kept where it runs)"), "{}", a.reason);
    // Where keeping does not fit, it is placed afresh rather than refused.
    let big = Config::parse(
        &format!(
            "{}{}",
            model("a", "gpu_memory = 0.9"),
            model("b", "gpu_memory = 0.9\nexclusive = true\ngpu_ids = [1]")
        ),
        "box.toml",
    )
    .unwrap();
    let keep = BTreeMap::from([("a".to_string(), vec![1])]);
    match place_config(&big, &machine, &keep).unwrap() {
        Planned::Placed(p) => assert_eq!(p.iter().find(|p| p.model == "a").unwrap().gpus, [0]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn default_placement_carries_the_fraction_so_the_argv_keeps_it() {
    let c = parse(&model("a", "gpus = 1\ngpu_ids = [0]\ngpu_memory = 0.4"));
    let p = default_placement(&c.models[0]);
    assert_eq!(p.gpus, [0]);
    assert_eq!(p.engine_args(), ["--gpu-memory-utilization", "0.4"]);
}

/// Config v1 `z` (pinned to GPU 0, exclusive) and `a`; v2 (a reload that
/// removed `z`): only `a`, which runs on GPU 1.
fn z_removed() -> (Config, Config) {
    let two = "[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n";
    let a = model("a", "gpu_memory = 0.5");
    let z = model("z", "gpu_ids = [0]\nexclusive = true");
    let v1 = Config::parse(&format!("{two}{z}{a}"), "box.toml").unwrap();
    let v2 = Config::parse(&format!("{two}{a}"), "box.toml").unwrap();
    (v1, v2)
}

fn gpus_of(planned: Planned, name: &str) -> Vec<u32> {
    match planned {
        Planned::Placed(p) => p.into_iter().find(|p| p.model == name).unwrap().gpus,
        other => panic!("{other:?}"),
    }
}

/// What a restart of the control plane after that reload places: afresh,
/// `a` would land on GPU 0 and its running engine (on GPU 1) be stopped;
/// given where it runs, it stays.
#[test]
fn a_restart_keeps_a_model_on_the_gpus_its_engine_runs_on() {
    let machine = Machine::uniform(2, 80 * GIB);
    let (v1, v2) = z_removed();
    let none = BTreeMap::new();
    assert_eq!(
        gpus_of(place_config(&v1, &machine, &none).unwrap(), "a"),
        [1]
    );
    assert_eq!(
        gpus_of(place_config(&v2, &machine, &none).unwrap(), "a"),
        [0]
    );
    let recorded = BTreeMap::from([("a".to_string(), vec![1])]);
    assert_eq!(
        gpus_of(place_config(&v2, &machine, &recorded).unwrap(), "a"),
        [1]
    );
}

/// One model that cannot stay where it ran (a model now pinned there,
/// exclusive) no longer moves the others: those that fit stay.
#[test]
fn models_that_fit_where_they_run_stay_when_another_cannot() {
    let machine = Machine::uniform(3, 80 * GIB);
    let c = parse(&format!(
        "[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n[[gpu]]\nindex = 2\nmemory = \"80GiB\"\n{}{}{}",
        model("a", "gpu_memory = 0.5"),
        model("b", "gpu_memory = 0.3"),
        model("c", "gpu_ids = [0]\nexclusive = true")
    ));
    let keep = BTreeMap::from([("a".to_string(), vec![2]), ("b".to_string(), vec![0])]);
    let Planned::Placed(p) = place_config(&c, &machine, &keep).unwrap() else {
        panic!("not placed")
    };
    let on = |m: &str| p.iter().find(|p| p.model == m).unwrap().gpus.clone();
    assert_eq!(on("a"), [2], "{p:?}");
    assert_ne!(on("b"), [0], "{p:?}");
    assert_eq!(on("c"), [0]);
    let a = p.iter().find(|p| p.model == "a").unwrap();
    assert!(a.reason.contains("(kept where it runs)"), "{}", a.reason);
}

/// The static check counts an asleep neighbour at the residual the run time
/// counts until it measures one (1 GiB at TP=1, 2.5 GiB per GPU above), or
/// at `asleep_residual` when set: not at one figure for every model.
#[test]
fn the_static_check_counts_the_run_times_residuals() {
    let check = |control: &str, gpus: u32, models: &str| {
        let inventory: String = (0..gpus)
            .map(|i| format!("[[gpu]]\nindex = {i}\nmemory = \"80GiB\"\n"))
            .collect();
        let c = Config::parse(&format!("{control}{inventory}{models}"), "box.toml").unwrap();
        place_config(&c, &Machine::uniform(gpus, 80 * GIB), &BTreeMap::new()).map(|_| ())
    };
    // TP=1: 78.8 GiB awake + 1 GiB of b asleep fits 80 GiB.
    let tp1 = format!(
        "{}{}",
        model("a", "gpu_memory = \"78.8GiB\""),
        model("b", "gpu_memory = \"10GiB\"")
    );
    assert!(check("", 1, &tp1).is_ok());
    // At 1.5 GiB, as configured, it does not.
    let e = check("[control]\nasleep_residual = \"1.5GiB\"\n", 1, &tp1).unwrap_err();
    assert!(
        e.to_string().contains("asleep residual of \"b\" 1.5 GiB"),
        "{e}"
    );
    // TP=2: 78 GiB awake + 2.5 GiB per GPU of b asleep does not fit.
    let tp2 = format!(
        "{}{}",
        model("a", "gpus = 2\ngpu_memory = \"78GiB\""),
        model("b", "gpus = 2\ngpu_memory = \"10GiB\"")
    );
    let e = check("", 2, &tp2).unwrap_err();
    assert!(
        e.to_string().contains("asleep residual of \"b\" 2.5 GiB"),
        "{e}"
    );
}
