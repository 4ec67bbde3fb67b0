//! The only unsafe code of siesta-control: three CUDA driver calls that
//! cudarc's safe API does not expose. Each is a plain FFI call on handles
//! that live cudarc objects own.
#![allow(unsafe_code)]

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, DriverError};

/// Whether libcuda can be loaded. cudarc panics on first use without it.
pub fn libcuda_present() -> bool {
    // SAFETY: only tries to dlopen the library and drops it.
    unsafe { sys::is_culib_present() }
}

/// cuDeviceCanAccessPeer: the driver's own claim, recorded, never trusted.
pub fn can_access_peer(from: &CudaContext, to: &CudaContext) -> Result<bool, DriverError> {
    let mut can: std::ffi::c_int = 0;
    // SAFETY: `can` is a valid out pointer; both devices come from live contexts.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device()).result()? };
    Ok(can != 0)
}

/// cuCtxEnablePeerAccess: let `from`'s context access `to`'s memory
/// directly. Already enabled counts as success.
pub fn enable_peer_access(from: &CudaContext, to: &CudaContext) -> Result<(), DriverError> {
    from.bind_to_thread()?;
    // SAFETY: `to.cu_ctx()` is a live primary context owned by `to`; flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(DriverError(e)),
    }
}

/// Whether an error means "this pair cannot do peer access".
pub fn is_unsupported(e: &DriverError) -> bool {
    matches!(
        e.0,
        CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED | CUresult::CUDA_ERROR_NOT_SUPPORTED
    )
}
