//! The only unsafe code of `siesta-cuda-checkpoint`: the CUDA driver's
//! checkpoint API, loaded from `libcuda.so.1` at run time (cudarc 0.19's
//! bindings lack it).
//!
//! Signatures, from CUDA 12.8+ `cuda.h` (driver API reference 6.37 "CUDA
//! Checkpointing", 7.7 `CUcheckpointLockArgs`):
//! ```c
//! CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
//! CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
//! CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
//! CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
//! CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
//! typedef struct CUcheckpointLockArgs_st {
//!     unsigned int timeoutMs;   /* 0: no timeout */
//!     unsigned int reserved0;   /* must be zero */
//!     cuuint64_t reserved1[7];  /* must be zeroed */
//! } CUcheckpointLockArgs;
//! typedef enum CUprocessState_enum {
//!     CU_PROCESS_STATE_RUNNING = 0, CU_PROCESS_STATE_LOCKED = 1,
//!     CU_PROCESS_STATE_CHECKPOINTED = 2, CU_PROCESS_STATE_FAILED = 3,
//! } CUprocessState;
//! ```
//! The optional `args` of checkpoint, restore and unlock are passed NULL.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};

type CuResult = c_int;

#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
type PidArgsFn = unsafe extern "C" fn(c_int, *mut std::ffi::c_void) -> CuResult;
type StateFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;

/// A process's checkpoint state as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcState {
    Running,
    Locked,
    Checkpointed,
    Failed,
    Other(i32),
}

impl ProcState {
    fn from_raw(v: c_int) -> Self {
        match v {
            0 => ProcState::Running,
            1 => ProcState::Locked,
            2 => ProcState::Checkpointed,
            3 => ProcState::Failed,
            v => ProcState::Other(v),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProcState::Running => "running",
            ProcState::Locked => "locked",
            ProcState::Checkpointed => "checkpointed",
            ProcState::Failed => "failed",
            ProcState::Other(_) => "unknown",
        }
    }
}

/// Why a driver call failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot load libcuda.so.1 (no NVIDIA driver here?): {0}")]
    NoLibrary(String),
    #[error("driver has no {0}: needs r570+")]
    MissingSymbol(&'static str),
    #[error("{call}(pid {pid}) failed: {}", result_name(*.code))]
    Call {
        call: &'static str,
        pid: i32,
        code: i32,
    },
    #[error("cuInit failed: {}", result_name(*.0))]
    Init(i32),
}

impl DriverError {
    pub fn code(&self) -> Option<i32> {
        match self {
            DriverError::Call { code, .. } | DriverError::Init(code) => Some(*code),
            _ => None,
        }
    }
}

/// The name of a `CUresult` (the ones the checkpoint API documents, and a
/// few it was seen to answer).
pub fn result_name(code: i32) -> String {
    let name = match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult {code}"),
    };
    format!("{name} ({code})")
}

/// The loaded driver with the checkpoint entry points resolved.
pub struct Driver {
    lock: LockFn,
    checkpoint: PidArgsFn,
    restore: PidArgsFn,
    unlock: PidArgsFn,
    get_state: StateFn,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Driver(libcuda.so.1)")
    }
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &'static str) -> Result<T, DriverError> {
    let cname = format!("{name}\0");
    // SAFETY: T is the function pointer type of `name` as declared in
    // cuda.h (see the module comment); the pointer is used only while
    // `lib` lives (Driver keeps it).
    unsafe { lib.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| DriverError::MissingSymbol(name))
}

impl Driver {
    /// Load libcuda, resolve the checkpoint API, `cuInit(0)`.
    pub fn load() -> Result<Self, DriverError> {
        // SAFETY: loading the NVIDIA driver library runs its initialisers,
        // which is what every CUDA program does.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }
            .map_err(|e| DriverError::NoLibrary(e.to_string()))?;
        let init: InitFn = symbol(&lib, "cuInit")?;
        let d = Driver {
            lock: symbol(&lib, "cuCheckpointProcessLock")?,
            checkpoint: symbol(&lib, "cuCheckpointProcessCheckpoint")?,
            restore: symbol(&lib, "cuCheckpointProcessRestore")?,
            unlock: symbol(&lib, "cuCheckpointProcessUnlock")?,
            get_state: symbol(&lib, "cuCheckpointProcessGetState")?,
            _lib: lib,
        };
        // SAFETY: cuInit takes flags by value; 0 is the only valid value.
        let r = unsafe { init(0) };
        if r != 0 {
            return Err(DriverError::Init(r));
        }
        Ok(d)
    }

    fn check(call: &'static str, pid: i32, code: CuResult) -> Result<(), DriverError> {
        if code == 0 {
            Ok(())
        } else {
            Err(DriverError::Call { call, pid, code })
        }
    }

    pub fn state(&self, pid: i32) -> Result<ProcState, DriverError> {
        let mut s: c_int = -1;
        // SAFETY: `s` is a valid out pointer for the call's duration.
        let r = unsafe { (self.get_state)(pid, &mut s) };
        Self::check("cuCheckpointProcessGetState", pid, r)?;
        Ok(ProcState::from_raw(s))
    }

    /// Lock: the process's CUDA calls block from here until unlocked.
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        let mut args = LockArgs {
            timeout_ms,
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: `args` is a valid, zero-reserved CUcheckpointLockArgs.
        let r = unsafe { (self.lock)(pid, &mut args) };
        Self::check("cuCheckpointProcessLock", pid, r)
    }

    pub fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: NULL is documented as "no optional arguments".
        let r = unsafe { (self.checkpoint)(pid, std::ptr::null_mut()) };
        Self::check("cuCheckpointProcessCheckpoint", pid, r)
    }

    pub fn restore(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: NULL is documented as "no optional arguments".
        let r = unsafe { (self.restore)(pid, std::ptr::null_mut()) };
        Self::check("cuCheckpointProcessRestore", pid, r)
    }

    pub fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: NULL is documented as "no optional arguments".
        let r = unsafe { (self.unlock)(pid, std::ptr::null_mut()) };
        Self::check("cuCheckpointProcessUnlock", pid, r)
    }
}
