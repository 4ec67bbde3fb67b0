//! The only unsafe code of siesta-control: CUDA driver calls that cudarc's
//! safe API does not expose, on handles that live cudarc contexts own.
//!
//! Buffers are plain `cuMemAlloc` memory, not cudarc's (stream-ordered pool
//! allocations): `cuCtxEnablePeerAccess` does not cover pool memory, so a
//! copy between pool buffers is staged through the host and the peer DMA
//! path under test is never exercised (seen on 2 × H200: 38 GB/s staged).
//! Plain device memory is also what NCCL's legacy path and vLLM's custom
//! all-reduce share between GPUs.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, DriverError, result};

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

/// `len` u32s of plain device memory (cuMemAlloc), freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: plain allocation in the bound context; freed exactly once in Drop.
        let ptr = unsafe { result::malloc_sync(len * 4) }?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Copy `host` (exactly `len` elements) to the device, synchronously.
    pub fn write(&mut self, host: &[u32]) -> Result<(), DriverError> {
        assert_eq!(host.len(), self.len);
        self.ctx.bind_to_thread()?;
        // SAFETY: `ptr` holds `len` u32s, `host` is exactly that long.
        unsafe { result::memcpy_htod_sync(self.ptr, host) }
    }

    /// Copy the device contents back to the host, synchronously.
    pub fn read(&self) -> Result<Vec<u32>, DriverError> {
        let mut host = vec![0u32; self.len];
        self.ctx.bind_to_thread()?;
        // SAFETY: `host` has room for exactly the `len` u32s at `ptr`.
        unsafe { result::memcpy_dtoh_sync(&mut host, self.ptr) }?;
        Ok(host)
    }

    /// cuMemcpyPeer from `src` (another GPU's buffer of the same length)
    /// into this one, then wait for both contexts.
    pub fn copy_from_peer(&mut self, src: &DeviceBuffer) -> Result<(), DriverError> {
        assert_eq!(src.len, self.len);
        self.ctx.bind_to_thread()?;
        // SAFETY: both pointers are live allocations of `len` u32s in their own contexts.
        unsafe {
            sys::cuMemcpyPeer(
                self.ptr,
                self.ctx.cu_ctx(),
                src.ptr,
                src.ctx.cu_ctx(),
                self.len * 4,
            )
            .result()?
        };
        self.ctx.synchronize()?;
        src.ctx.synchronize()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
