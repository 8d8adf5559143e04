//! The CUDA backend (cargo feature `cuda`): device handle, device buffers,
//! NVRTC compilation and the per-device module cache, kernel timing.
//!
//! Everything kvpack submits runs on one compute stream per device (plus a
//! copy stream inside [`FileDecoder`]), ordered by the stream and by
//! explicit events, so cudarc's automatic per-buffer event tracking is off
//! for kvpack's context handle and device memory is managed as raw
//! allocations ([`GpuBuffer`]).

mod decode;
mod encode;
mod frame;
mod paged;
mod stage;
mod stream;

pub use decode::{DecodePlan, GpuPages};
pub use encode::EncodePlan;
pub use paged::{GatherPlan, PagedJob};
pub use stream::FileDecoder;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig, PinnedHostSlice,
    PushKernelArg, result, sys,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::GpuInfo;
use super::decplan::Args;
use super::sources::{self, Source};
use super::spec::KernelOptions;
use crate::error::{Error, Result};

/// Maps a CUDA driver failure to [`Error::Device`] with what kvpack was
/// doing.
pub(crate) fn cuda_err(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::device(format!("CUDA {what}"), format!("{e:?}"))
}

/// True when the CUDA driver library can be loaded.
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// True when the NVRTC library can be loaded.
fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// A CUDA device with kvpack's compute stream and compiled kernels.
///
/// Cheap to clone (shared handle). [`Gpu::new`] returns the same handle for
/// the same ordinal within a process, so kernels are compiled once per
/// device (NVRTC for the device's compute capability, on first use of each
/// source file).
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<Inner>,
    /// The stream this handle submits to: kvpack's own, or a caller's
    /// ([`Gpu::with_stream`]).
    stream: Arc<CudaStream>,
    /// Kernel selection options ([`Gpu::with_kernel_options`]).
    pub(crate) options: KernelOptions,
}

/// A device file's length and the `(offset, len)` spans of its page heads.
type FrameHeads = (u64, Vec<(u64, u64)>);

struct Inner {
    ctx: Arc<CudaContext>,
    info: GpuInfo,
    /// Pinned host staging buffers of finished paged jobs, for reuse.
    pinned: Mutex<Vec<PinnedHostSlice<u8>>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Dynamic shared memory limit raised per kernel (bytes).
    smem: Mutex<HashMap<String, u32>>,
    /// File length and page-head spans of the last device-checked decode
    /// (`frame.rs`): the next file of that length (the next layer of a
    /// handoff) reads them back speculatively with its head and tail.
    frame_heads: Mutex<Option<FrameHeads>>,
    /// The host image of the last device-checked decode, for reuse.
    shadow: Mutex<Option<frame::Shadow>>,
    /// The plan of the last device-checked decode: the next layer of a
    /// handoff has the same structure and reuses it (`frame.rs`).
    plan: Mutex<Option<frame::CachedPlan>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.inner.info)
            .finish()
    }
}

impl Gpu {
    /// Number of CUDA devices, 0 when the driver library or a device is
    /// missing.
    pub fn device_count() -> usize {
        if !driver_present() {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }

    /// Opens device `ordinal` (shared handle per ordinal).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the CUDA driver or NVRTC library cannot
    /// be loaded, or there is no such device; [`Error::Device`] when the driver
    /// fails to create a context or stream.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Gpu>>> = OnceLock::new();
        let devices = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = map.get(&ordinal) {
            return Ok(g.clone());
        }
        if !driver_present() {
            return Err(Error::Unsupported(
                "no CUDA driver library (libcuda.so) found: this machine has no NVIDIA driver"
                    .into(),
            ));
        }
        if !nvrtc_present() {
            return Err(Error::Unsupported(
                "no NVRTC library (libnvrtc.so) found: install the CUDA toolkit's runtime \
                 compiler or add its lib64 folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let count = Self::device_count();
        if ordinal >= count {
            return Err(Error::Unsupported(format!(
                "no CUDA device {ordinal}: {count} device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("context creation"))?;
        // SAFETY: kvpack orders all of its work itself (one compute stream,
        // explicit events for the copy stream of FileDecoder) and allocates
        // device memory as raw allocations, never as CudaSlice; turning off
        // cudarc's per-slice tracking for this handle changes nothing else.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("stream creation"))?;
        let attr = |a| ctx.attribute(a).map_err(cuda_err("device query"));
        let info = GpuInfo {
            ordinal,
            name: ctx.name().map_err(cuda_err("device query"))?,
            compute_capability: ctx.compute_capability().map_err(cuda_err("device query"))?,
            multiprocessors: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )? as u32,
            memory_bytes: ctx.total_mem().map_err(cuda_err("device query"))? as u64,
            l2_bytes: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
        };
        let g = Gpu {
            inner: Arc::new(Inner {
                ctx,
                info,
                pinned: Mutex::new(Vec::new()),
                modules: Mutex::new(HashMap::new()),
                functions: Mutex::new(HashMap::new()),
                smem: Mutex::new(HashMap::new()),
                frame_heads: Mutex::new(None),
                shadow: Mutex::new(None),
                plan: Mutex::new(None),
            }),
            stream,
            options: KernelOptions::default(),
        };
        map.insert(ordinal, g.clone());
        Ok(g)
    }

    /// Name, compute capability and sizes of the device.
    pub fn info(&self) -> &GpuInfo {
        &self.inner.info
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// This handle for submitting to `stream` instead: a raw `CUstream` of
    /// the device's primary context, such as a serving engine's current
    /// stream (`torch.cuda.current_stream().cuda_stream`; 0 is the legacy
    /// default stream). Everything done through the returned handle
    /// (allocations, copies, kernel launches, and the stream-ordered frees
    /// of buffers it allocated) is enqueued on that stream, ordered after
    /// the work the caller enqueued there before. kvpack never
    /// synchronizes the device or the context; the calls that document a
    /// wait ([`GpuBuffer::write`], [`Gpu::download`], [`Gpu::synchronize`])
    /// synchronize only this stream. The kernels and device memory are
    /// shared with `self`.
    ///
    /// # Safety
    /// `stream` must be a valid stream of this device's primary context
    /// (the one torch uses), and stay valid for as long as the returned
    /// handle, or any buffer, plan or job made with it, lives (their drops
    /// enqueue frees on it).
    pub unsafe fn with_stream(&self, stream: u64) -> Gpu {
        // SAFETY: the caller guarantees `stream` is a live stream of this
        // context that outlives everything using the wrapper; cudarc does
        // not destroy a borrowed stream.
        let s = unsafe {
            self.ctx()
                .wrap_borrowed_stream(stream as usize as sys::CUstream)
        };
        Gpu {
            inner: self.inner.clone(),
            stream: s,
            options: self.options,
        }
    }

    /// This handle choosing kernels with `options` for the plans it builds
    /// from now on (benchmark knobs; results are identical).
    pub fn with_kernel_options(&self, options: KernelOptions) -> Gpu {
        Gpu {
            options,
            ..self.clone()
        }
    }

    /// The raw `CUstream` this handle submits to (for interop, e.g. to wrap
    /// kvpack's own stream in a framework's stream object).
    pub fn raw_stream(&self) -> u64 {
        self.stream.cu_stream() as usize as u64
    }

    /// Pinned host memory of at least `len` bytes, reused from finished
    /// jobs when one is large enough.
    pub(crate) fn take_pinned(&self, len: usize) -> Result<PinnedHostSlice<u8>> {
        let mut pool = self.inner.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = (0..pool.len())
            .filter(|&i| pool[i].len() >= len)
            .min_by_key(|&i| pool[i].len())
        {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        let n = len.max(1 << 20).next_power_of_two();
        // SAFETY: kvpack writes the bytes it stages before any of them is
        // copied to the device; plain (not write-combined) memory, since
        // the host also reads results back from it.
        unsafe { self.ctx().alloc_pinned_with_flags::<u8>(n, 0) }
            .map_err(cuda_err("pinned allocation"))
    }

    /// Returns a pinned buffer no pending copy uses to the pool (at most
    /// four are kept; the smallest is freed first).
    pub(crate) fn give_pinned(&self, p: PinnedHostSlice<u8>) {
        let mut pool = self.inner.pinned.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(p);
        if pool.len() > 4 {
            pool.sort_by_key(|b| std::cmp::Reverse(b.len()));
            pool.truncate(4);
        }
    }

    /// Waits until all work submitted through this handle's stream is
    /// done (a stream synchronize; never the device).
    ///
    /// # Errors
    /// [`Error::Device`] for a failed kernel or copy.
    pub fn synchronize(&self) -> Result<()> {
        self.stream().synchronize().map_err(cuda_err("synchronize"))
    }

    /// Compiles (once per device) and loads the module of `src`.
    fn module(&self, src: Source) -> Result<Arc<CudaModule>> {
        let mut m = self.inner.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(module) = m.get(src.name) {
            return Ok(module.clone());
        }
        let cc = self.info().compute_capability;
        let (ptx, cached) = compile_cached(src, cc)?;
        let module = match (self.ctx().load_module(ptx), cached) {
            (Ok(module), _) => module,
            // A cached entry the driver refuses (another driver, a damaged
            // file): forget it and compile afresh.
            (Err(_), Some((dir, key))) => {
                super::ptx_cache::forget(&dir, src.name, &key);
                self.ctx()
                    .load_module(compile(src, cc)?)
                    .map_err(cuda_err(&format!("loading module {}", src.name)))?
            }
            (Err(e), None) => return Err(cuda_err(&format!("loading module {}", src.name))(e)),
        };
        m.insert(src.name, module.clone());
        Ok(module)
    }

    /// The kernel `name` of source module `source` (compiled on first use).
    pub(crate) fn function(&self, source: &str, name: &str) -> Result<CudaFunction> {
        if let Some(f) = self
            .inner
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            return Ok(f.clone());
        }
        let src = sources::ALL
            .into_iter()
            .find(|s| s.name == source)
            .ok_or_else(|| Error::param(format!("internal: no kernel source {source:?}")))?;
        let f = self
            .module(src)?
            .load_function(name)
            .map_err(cuda_err(&format!("loading kernel {name}")))?;
        self.inner
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Compiles every kernel source now (otherwise done on first use), so
    /// that compile time stays out of measurements.
    ///
    /// # Errors
    /// [`Error::Device`] naming the source when NVRTC or the driver rejects it.
    pub fn warm_up(&self) -> Result<()> {
        for s in sources::ALL {
            self.module(s)?;
        }
        Ok(())
    }

    /// A zero-filled buffer of `len` elements.
    ///
    /// # Errors
    /// [`Error::Device`] when the allocation fails (out of memory).
    pub fn alloc<T: GpuElem>(&self, len: usize) -> Result<GpuBuffer<T>> {
        let b = self.alloc_uninit::<T>(len)?;
        // SAFETY: exactly the buffer's bytes, on the stream it was
        // allocated on, before any use.
        unsafe {
            result::memset_d8_async(
                b.ptr,
                0,
                len * std::mem::size_of::<T>(),
                self.stream().cu_stream(),
            )
        }
        .map_err(cuda_err("memset"))?;
        Ok(b)
    }

    /// A buffer of `len` elements whose content is undefined until written
    /// (stream-ordered allocation on this handle's stream where the device
    /// has memory pools).
    pub(crate) fn alloc_uninit<T: GpuElem>(&self, len: usize) -> Result<GpuBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::param("GPU allocation size overflows"))?;
        self.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
        let s = self.stream().cu_stream();
        // SAFETY: a fresh allocation of `bytes` (at least 1) on our stream
        // (or synchronous where the device has no memory pools); T is Pod,
        // so any bytes are a valid value once written.
        let ptr = unsafe {
            if self.ctx().has_async_alloc() {
                result::malloc_async(s, bytes.max(1))
            } else {
                result::malloc_sync(bytes.max(1))
            }
        }
        .map_err(cuda_err("allocation"))?;
        Ok(GpuBuffer {
            ptr,
            len,
            owned: true,
            gpu: self.clone(),
            _t: PhantomData,
        })
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Errors
    /// As [`Gpu::alloc`].
    pub fn upload<T: GpuElem>(&self, data: &[T]) -> Result<GpuBuffer<T>> {
        let b = self.alloc::<T>(data.len())?;
        b.write(data)?;
        Ok(b)
    }

    /// A buffer holding a copy of `data`, enqueued on this handle's stream
    /// without waiting. `data` must be pageable host memory (an ordinary
    /// allocation, neither pinned nor registered with CUDA): an
    /// asynchronous copy from pageable memory returns once the driver has
    /// copied the bytes to its own staging (CUDA's documented behaviour),
    /// so `data` may change or be freed as soon as this returns, and the
    /// device sees the copy in stream order. Saves [`Gpu::upload`]'s
    /// memset and stream synchronize on the hot paths.
    ///
    /// # Errors
    /// As [`Gpu::alloc`].
    pub(crate) fn upload_pageable<T: GpuElem>(&self, data: &[T]) -> Result<GpuBuffer<T>> {
        let b = self.alloc_uninit::<T>(data.len())?;
        if !data.is_empty() {
            // SAFETY: `b` holds data.len() elements; the copy is ordered on
            // our stream before any use of `b`, and `data` is pageable (the
            // caller's contract), staged by the driver before the return.
            unsafe { result::memcpy_htod_async(b.ptr, data, self.stream().cu_stream()) }
                .map_err(cuda_err("host-to-device copy"))?;
        }
        Ok(b)
    }

    /// Copies `buf` to the host (waits for pending work on the stream).
    ///
    /// # Errors
    /// [`Error::Device`] for a failed copy or an earlier failed kernel.
    pub fn download<T: GpuElem>(&self, buf: &GpuBuffer<T>) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); buf.len];
        self.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
        // SAFETY: `buf` holds `len` elements of T; `v` has room for them; the
        // stream is synchronized before `v` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut v[..], buf.ptr, self.stream().cu_stream())
                .map_err(cuda_err("device-to-host copy"))?;
        }
        self.synchronize()?;
        Ok(v)
    }

    /// Times `f` (which submits work to kvpack's stream) with CUDA events:
    /// milliseconds from before the first to after the last submission.
    ///
    /// # Errors
    /// The error of `f`, or [`Error::Device`] from the events.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = self.ctx().new_event(flags).map_err(cuda_err("event"))?;
        let b = self.ctx().new_event(flags).map_err(cuda_err("event"))?;
        a.record(self.stream()).map_err(cuda_err("event record"))?;
        f()?;
        b.record(self.stream()).map_err(cuda_err("event record"))?;
        let ms = a.elapsed_ms(&b).map_err(cuda_err("event timing"))?;
        Ok(f64::from(ms))
    }

    /// Device-to-device copy of `src` into `dst` with the 16-byte copy
    /// kernel (the bandwidth ceiling kvpack's kernels are compared with),
    /// or with the driver's copy when `driver` is true.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the lengths differ or are not a multiple
    /// of 16 bytes; [`Error::Device`] on launch failure.
    pub fn copy(&self, src: &GpuBuffer<u8>, dst: &GpuBuffer<u8>, driver: bool) -> Result<()> {
        if src.len != dst.len || !src.len.is_multiple_of(16) {
            return Err(Error::param(
                "copy needs equal lengths that are multiples of 16 bytes",
            ));
        }
        if driver {
            // SAFETY: both buffers hold `len` bytes; ordered on our stream.
            return unsafe {
                result::memcpy_dtod_async(dst.ptr, src.ptr, src.len, self.stream().cu_stream())
            }
            .map_err(cuda_err("device-to-device copy"));
        }
        let f = self.function("copy", "copy_u128")?;
        let n = (src.len / 16) as u64;
        let blocks = (self.info().multiprocessors * 8).max(1);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (super::spec::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream().launch_builder(&f);
        l.arg(&src.ptr).arg(&dst.ptr).arg(&n);
        // SAFETY: copy_u128(const uint4*, uint4*, u64 n) reads and writes n
        // 16-byte elements, within both buffers.
        unsafe { l.launch(cfg) }.map_err(cuda_err("launch copy_u128"))?;
        Ok(())
    }

    /// Launches `name` over `work` (one block per item) with the common
    /// leading arguments (descriptor table, work list) then `extra`.
    pub(crate) fn launch_items(
        &self,
        k: &super::spec::KernelChoice,
        descs: u64,
        work: u64,
        blocks: u32,
        extra: &Args,
    ) -> Result<()> {
        if blocks == 0 {
            return Ok(());
        }
        let f = self.function(k.source, &k.name)?;
        // Raise the dynamic shared memory limit for any kernel that takes
        // some: with its static shared memory it may pass the default 48 KiB.
        if k.shared > 0 {
            let mut m = self.inner.smem.lock().unwrap_or_else(|e| e.into_inner());
            if m.get(&k.name).is_none_or(|&v| v < k.shared) {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    k.shared as i32,
                )
                .map_err(cuda_err(&format!("shared memory limit of {}", k.name)))?;
                m.insert(k.name.clone(), k.shared);
            }
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (k.grid.threads(), 1, 1),
            shared_mem_bytes: k.shared,
        };
        let mut l = self.stream().launch_builder(&f);
        l.arg(&descs).arg(&work);
        if let Some(b) = &extra.bits {
            l.arg(b);
        }
        if let Some(h) = &extra.h {
            l.arg(h);
        }
        if let Some(c) = &extra.c {
            l.arg(c);
        }
        l.arg(&extra.status);
        // SAFETY: every kernel of kernels/*.cu takes (descriptor table, work
        // list, [bits|src_type], [h], [c], status) exactly as pushed here
        // (spec::KernelChoice picks the name, `Args` the optional ones); the
        // descriptors were built by spec.rs against buffers that outlive the
        // launch (held by the plan), and every access is bounded by them.
        unsafe { l.launch(cfg) }.map_err(cuda_err(&format!("launch {}", k.name)))?;
        Ok(())
    }
}

/// NVRTC options for compute capability `cc`: no fused multiply-add
/// contraction, no flush-to-zero, IEEE division and square root.
fn compile_options(cc: (i32, i32)) -> CompileOptions {
    CompileOptions {
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        use_fast_math: Some(false),
        options: vec![
            format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
            "--std=c++17".into(),
        ],
        ..Default::default()
    }
}

/// Compiles a source with NVRTC for compute capability `cc` (see
/// [`compile_options`]).
fn compile(src: Source, cc: (i32, i32)) -> Result<Ptx> {
    cudarc::nvrtc::compile_ptx_with_opts(src.full_text(), compile_options(cc))
        .map_err(|e| Error::device(format!("NVRTC compiling {}.cu", src.name), format!("{e:?}")))
}

/// The NVRTC library's version, `"nvrtc MAJOR.MINOR"` (part of the PTX
/// cache key).
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through the pointers given,
    // which point at live locals; it needs no other state.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("nvrtc {major}.{minor} ({r:?})")
}

/// [`compile`] through the on-disk PTX cache ([`super::ptx_cache`]):
/// returns the PTX and, when it came from the cache, the directory and key
/// of its entry (so that an entry the driver refuses can be forgotten).
fn compile_cached(
    src: Source,
    cc: (i32, i32),
) -> Result<(Ptx, Option<(std::path::PathBuf, String)>)> {
    use super::ptx_cache;
    let Some(dir) = ptx_cache::dir() else {
        return Ok((compile(src, cc)?, None));
    };
    let opts = compile_options(cc);
    let described = format!("{opts:?}");
    let text = src.full_text();
    let key = ptx_cache::key(&nvrtc_version(), &[described], &text);
    if let Some(ptx) = ptx_cache::load(&dir, src.name, &key) {
        return Ok((Ptx::from_src(ptx), Some((dir, key))));
    }
    let ptx = compile(src, cc)?;
    ptx_cache::store(&dir, src.name, &key, &ptx.to_src());
    Ok((ptx, None))
}

/// Compiles every kernel source with NVRTC for compute capability `cc`
/// without touching a device (needs only libnvrtc), returning each
/// source's PTX. Used by tests and by tools that inspect the generated
/// code.
///
/// # Errors
/// [`Error::Unsupported`] without libnvrtc; [`Error::Device`] with the compiler
/// log when a source does not compile.
pub fn compile_all(cc: (i32, i32)) -> Result<Vec<(&'static str, String)>> {
    if !nvrtc_present() {
        return Err(Error::Unsupported(
            "no NVRTC library (libnvrtc.so) found".into(),
        ));
    }
    sources::ALL
        .into_iter()
        .map(|s| Ok((s.name, compile(s, cc)?.to_src())))
        .collect()
}

/// Element types a [`GpuBuffer`] can hold.
pub trait GpuElem:
    Copy + bytemuck::Pod + cudarc::driver::DeviceRepr + Send + Sync + 'static
{
}
impl GpuElem for u8 {}
impl GpuElem for u16 {}
impl GpuElem for u32 {}
impl GpuElem for u64 {}
impl GpuElem for i32 {}
impl GpuElem for i64 {}
impl GpuElem for f32 {}

/// A device allocation of `len` elements of `T` (owned), or a borrowed view
/// of memory owned by someone else (for example a serving engine's KV
/// cache tensor, see [`GpuBuffer::from_raw_parts`]).
///
/// Kernels write device memory through shared references (as CUDA
/// launches do): a decode target is a `&GpuBuffer`.
pub struct GpuBuffer<T: GpuElem> {
    ptr: u64,
    len: usize,
    owned: bool,
    gpu: Gpu,
    _t: PhantomData<T>,
}

impl<T: GpuElem> std::fmt::Debug for GpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBuffer")
            .field("ptr", &format_args!("0x{:x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl<T: GpuElem> GpuBuffer<T> {
    /// Wraps device memory owned elsewhere (not freed on drop).
    ///
    /// # Safety
    /// `ptr` must be a device address on `gpu`'s device holding `len`
    /// elements of `T`, valid and not used concurrently by other streams
    /// for as long as the returned buffer (and any plan using it) lives.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `ptr` is not 16-byte aligned (the kernels
    /// use 16-byte stores).
    pub unsafe fn from_raw_parts(gpu: &Gpu, ptr: u64, len: usize) -> Result<GpuBuffer<T>> {
        if !ptr.is_multiple_of(16) {
            return Err(Error::param(format!(
                "device pointer 0x{ptr:x} is not 16-byte aligned"
            )));
        }
        Ok(GpuBuffer {
            ptr,
            len,
            owned: false,
            gpu: gpu.clone(),
            _t: PhantomData,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (for interop, e.g. wrapping it as a tensor).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device this buffer lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Overwrites the first `data.len()` elements (ordered on kvpack's
    /// stream; returns when the copy is done).
    ///
    /// # Errors
    /// [`Error::Parameter`] when `data` is longer than the buffer;
    /// [`Error::Device`] when the copy fails.
    pub fn write(&self, data: &[T]) -> Result<()> {
        if data.len() > self.len {
            return Err(Error::param("write past the end of a GPU buffer"));
        }
        self.gpu.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
        // SAFETY: the buffer holds at least data.len() elements; the stream
        // is synchronized before `data` may be freed by the caller.
        unsafe {
            result::memcpy_htod_async(self.ptr, data, self.gpu.stream().cu_stream())
                .map_err(cuda_err("host-to-device copy"))?;
        }
        self.gpu.synchronize()
    }

    /// Sets every byte of the buffer to `byte`.
    ///
    /// # Errors
    /// [`Error::Device`] when the memset fails.
    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        self.gpu.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
        // SAFETY: exactly the buffer's bytes, on our stream.
        unsafe {
            result::memset_d8_async(
                self.ptr,
                byte,
                self.len * std::mem::size_of::<T>(),
                self.gpu.stream().cu_stream(),
            )
        }
        .map_err(cuda_err("memset"))
    }

    /// Copies the buffer to the host.
    ///
    /// # Errors
    /// As [`Gpu::download`].
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.gpu.download(self)
    }
}

impl<T: GpuElem> Drop for GpuBuffer<T> {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let ctx = self.gpu.ctx();
        ctx.record_err(ctx.bind_to_thread());
        let stream = self.gpu.stream();
        if ctx.has_async_alloc() {
            // SAFETY: we own this allocation; freeing on the stream that all
            // kvpack work is ordered on runs after every use of it.
            ctx.record_err(unsafe { result::free_async(self.ptr, stream.cu_stream()) });
        } else {
            ctx.record_err(stream.synchronize());
            // SAFETY: we own this allocation and the stream is idle.
            ctx.record_err(unsafe { result::free_sync(self.ptr) });
        }
    }
}
