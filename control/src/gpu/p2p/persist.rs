//! P2P results on disk: `STATE_DIR/p2p.json`, written atomically (tmp,
//! fsync, rename, fsync the directory) and read back at start, so a box's
//! verdicts survive restarts of siesta-control.
//!
//! ```json
//! {"probed_unix_ms": 1764450000000, "gpu_uuids": ["GPU-…", "GPU-…"],
//!  "results": [{"src": 0, "dst": 1, "health": "corrupt", "corrupt_elements": 9}]}
//! ```
//! Every field but `src`, `dst` and `health` of a result may be left out.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::P2pResult;

/// The file name inside the state directory.
pub const FILE_NAME: &str = "p2p.json";

/// What is kept of the last probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedProbe {
    /// When it ran (unix ms).
    #[serde(default)]
    pub probed_unix_ms: i64,
    /// UUIDs of the GPUs it ran on, by index order (empty: not known, e.g. a
    /// configured inventory). Results of other GPUs are not used.
    #[serde(default)]
    pub gpu_uuids: Vec<String>,
    pub results: Vec<P2pResult>,
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a P2P result file: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// `STATE_DIR/p2p.json`.
pub fn path_in(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

/// Reads the saved probe; `Ok(None)` if there is none.
pub fn load(path: &Path) -> Result<Option<SavedProbe>, PersistError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(PersistError::Io {
                path: path.into(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| PersistError::Parse {
            path: path.into(),
            source,
        })
}

/// Writes `saved` to `path` atomically (creating the directory).
pub fn save(path: &Path, saved: &SavedProbe) -> Result<(), PersistError> {
    let io = |source| PersistError::Io {
        path: path.into(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let text = serde_json::to_vec_pretty(saved).map_err(|e| io(std::io::Error::other(e)))?;
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&text).map_err(io)?;
        f.write_all(b"\n").map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

impl SavedProbe {
    /// Why these results do not apply to GPUs with `uuids` (index order),
    /// if they do not: both lists known and different.
    pub fn mismatch(&self, uuids: &[String]) -> Option<String> {
        let known = |l: &[String]| !l.is_empty() && l.iter().all(|u| !u.is_empty());
        (known(&self.gpu_uuids) && known(uuids) && self.gpu_uuids != uuids).then(|| {
            format!(
                "probed on GPUs [{}], the box now has [{}]",
                self.gpu_uuids.join(", "),
                uuids.join(", ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::p2p::P2pHealth;

    #[test]
    fn saved_results_round_trip_and_leave_no_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_in(&dir.path().join("state"));
        assert!(load(&path).unwrap().is_none());
        let saved = SavedProbe {
            probed_unix_ms: 42,
            gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
            results: vec![P2pResult::missing(0, 1, P2pHealth::Corrupt, "9 wrong")],
        };
        save(&path, &saved).unwrap();
        assert_eq!(load(&path).unwrap(), Some(saved.clone()));
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(FILE_NAME)]);
        save(&path, &SavedProbe::default()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(SavedProbe::default()));
    }

    #[test]
    fn a_hand_written_file_needs_only_the_verdicts() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_in(dir.path());
        std::fs::write(
            &path,
            r#"{"results":[{"src":0,"dst":1,"health":"corrupt"},{"src":1,"dst":0,"health":"ok"}]}"#,
        )
        .unwrap();
        let s = load(&path).unwrap().unwrap();
        assert_eq!(s.results.len(), 2);
        assert_eq!(s.results[0].health, P2pHealth::Corrupt);
        assert_eq!(s.probed_unix_ms, 0);
        std::fs::write(&path, "not json").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("p2p.json: not a P2P result file"), "{e}");
    }

    #[test]
    fn results_of_other_gpus_do_not_apply() {
        let s = SavedProbe {
            gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
            ..SavedProbe::default()
        };
        assert!(s.mismatch(&["GPU-a".into(), "GPU-b".into()]).is_none());
        assert!(s.mismatch(&[String::new(), String::new()]).is_none());
        assert!(s.mismatch(&[]).is_none());
        let why = s.mismatch(&["GPU-a".into(), "GPU-c".into()]).unwrap();
        assert!(why.contains("GPU-c"), "{why}");
    }
}
