//! Engine ports: where siesta picks them, the check that a model's `host`
//! can have one, and the book that keeps one model's pick off another
//! model's port.

use crate::config::{Config, ConfigError, Launch, ModelConfig, Problem};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Lowest port handed to engines.
const ENGINE_PORTS_FROM: u16 = 20_000;

/// Where engine ports are picked: from [`ENGINE_PORTS_FROM`] up to the start
/// of the kernel's ephemeral range (`ip_local_port_range`, 32768 by
/// default), so no outgoing connection (the kernel binds those from the
/// ephemeral range) can take an engine's port between the pick and the
/// engine's own bind. None: the ephemeral range leaves no room below it.
fn engine_port_range() -> Option<Range<u16>> {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    (start > ENGINE_PORTS_FROM + 1_000).then_some(ENGINE_PORTS_FROM..start)
}

/// Whether `port` on `host` can be bound now.
pub fn port_is_free(host: &str, port: u16) -> bool {
    std::net::TcpListener::bind((host, port)).is_ok()
}

/// The process engines among `models` whose port siesta picks, on a
/// `host` that is no address of this machine (no port can be picked
/// there): each named by its key in `config`'s file. The daemon refuses to
/// start on them, a reload to add them, and `siesta config check` says so
/// first. (Here, not in `config`: it binds, and `config` reads only.)
pub fn check_hosts(
    config: &Config,
    models: impl Fn(&ModelConfig) -> bool,
) -> Result<(), ConfigError> {
    let problems: Vec<Problem> = config
        .models
        .iter()
        .enumerate()
        .filter(|(_, m)| models(m))
        .filter_map(|(i, m)| {
            let Launch::Process {
                host, port: None, ..
            } = &m.launch
            else {
                return None;
            };
            let e = free_port(host).err()?;
            Some(Problem {
                key: format!("model[{i}].host"),
                message: format!("model {:?}: {e}", m.name),
            })
        })
        .collect();
    if problems.is_empty() {
        return Ok(());
    }
    Err(ConfigError {
        origin: config.origin.clone(),
        problems,
    })
}

/// A free TCP port on `host` (bound and released): a random one below the
/// ephemeral range where there is room, else one the kernel picks.
pub fn free_port(host: &str) -> std::io::Result<u16> {
    free_port_in(host, engine_port_range(), |_| false)
}

/// A free port on `host` for which `taken` is false: a random one of
/// `range` where there is room, else one the kernel picks.
fn free_port_in(
    host: &str,
    range: Option<Range<u16>>,
    taken: impl Fn(u16) -> bool,
) -> std::io::Result<u16> {
    let pick = || {
        if let Some(range) = range {
            for _ in 0..64 {
                let port = rand::random_range(range.clone());
                if !taken(port) && port_is_free(host, port) {
                    return Ok(port);
                }
            }
        }
        let mut last = None;
        for _ in 0..16 {
            let l = std::net::TcpListener::bind((host, 0))?;
            let port = l.local_addr()?.port();
            if !taken(port) {
                return Ok(port);
            }
            last = Some(port);
        }
        Err(std::io::Error::other(format!(
            "every port tried is another model's (the last, {})",
            last.unwrap_or_default()
        )))
    };
    pick().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot pick a free port on {host:?}: {e} (a model's `host` must be an address of this machine)"),
        )
    })
}

/// Every model's engine port: its fixed `port` from the configuration, or
/// the one siesta picked for it (or found its adopted engine on). A pick
/// for one model never takes another's: a stopped model's fixed port is
/// free to bind until its engine starts, and an engine that found it taken
/// would fail its start.
#[derive(Debug, Clone, Default)]
pub struct PortBook(Arc<Mutex<BTreeMap<String, u16>>>);

impl PortBook {
    /// The models configured now (at start-up, at each reload): their
    /// fixed ports recorded, models no longer configured forgotten, picks
    /// of the others kept.
    pub fn configure(&self, models: &[ModelConfig]) {
        let mut book = self.0.lock().unwrap();
        book.retain(|name, _| models.iter().any(|m| &m.name == name));
        for m in models {
            if let Launch::Process {
                port: Some(port), ..
            } = &m.launch
            {
                book.insert(m.name.clone(), *port);
            }
        }
    }

    /// Records `port` as `name`'s (an adopted engine's).
    pub fn record(&self, name: &str, port: u16) {
        self.0.lock().unwrap().insert(name.to_string(), port);
    }

    /// A free port on `host` that is no other model's, recorded as
    /// `name`'s.
    pub fn pick(&self, name: &str, host: &str) -> std::io::Result<u16> {
        self.pick_in(name, host, engine_port_range())
    }

    fn pick_in(&self, name: &str, host: &str, range: Option<Range<u16>>) -> std::io::Result<u16> {
        let mut book = self.0.lock().unwrap();
        let others = |port: u16| book.iter().any(|(n, p)| *p == port && n != name);
        let port = free_port_in(host, range, others)?;
        book.insert(name.to_string(), port);
        Ok(port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_ports_are_picked_below_the_ephemeral_range_and_are_free() {
        let p = free_port("127.0.0.1").unwrap();
        if let Some(range) = engine_port_range() {
            assert!(range.contains(&p), "{p} outside {range:?}");
        }
        assert!(port_is_free("127.0.0.1", p));
        let held = std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        assert!(!port_is_free("127.0.0.1", p));
        drop(held);
    }

    /// Two free neighbouring ports of the engine range.
    fn two_free_ports() -> Range<u16> {
        let range = engine_port_range().unwrap_or(20_000..32_000);
        (0..1000)
            .map(|_| rand::random_range(range.start..range.end - 1))
            .find(|p| port_is_free("127.0.0.1", *p) && port_is_free("127.0.0.1", p + 1))
            .map(|p| p..p + 2)
            .expect("two free neighbouring ports")
    }

    /// A model's pick never takes another model's fixed port, though that
    /// port is free (its engine is not running), and never another
    /// model's pick; a model may take its own port again.
    #[test]
    fn a_pick_avoids_the_other_models_ports() {
        let config = Config::parse(
            r#"
[[model]]
name = "fixed"
model = "m"
command = ["true"]
gpus = 0
port = 1

[[model]]
name = "picked"
model = "m"
command = ["true"]
gpus = 0
"#,
            "c.toml",
        )
        .unwrap();
        for _ in 0..16 {
            let range = two_free_ports();
            let mut models = config.models.clone();
            let Launch::Process { port, .. } = &mut models[0].launch else {
                panic!("a process model");
            };
            *port = Some(range.start);
            let book = PortBook::default();
            book.configure(&models);
            let p = book
                .pick_in("picked", "127.0.0.1", Some(range.clone()))
                .unwrap();
            assert_eq!(p, range.start + 1, "the fixed model's port was picked");
            // The second port is `picked`'s now: another model gets neither.
            let third = book
                .pick_in("third", "127.0.0.1", Some(range.clone()))
                .unwrap();
            assert!(!range.contains(&third), "{third} is another model's");
            // Its own port again, after a failure, is allowed.
            let again = book
                .pick_in("picked", "127.0.0.1", Some(range.clone()))
                .unwrap();
            assert_eq!(again, range.start + 1);
        }
    }

    /// A reload forgets the models it removes: their ports are free for
    /// picks again.
    #[test]
    fn a_removed_models_port_is_free_again() {
        let range = two_free_ports();
        let book = PortBook::default();
        book.record("gone", range.start);
        book.record("other", range.start + 1);
        book.configure(&[]);
        let p = book
            .pick_in("new", "127.0.0.1", Some(range.clone()))
            .unwrap();
        assert!(range.contains(&p), "{p}");
    }
}
