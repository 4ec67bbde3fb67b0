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
