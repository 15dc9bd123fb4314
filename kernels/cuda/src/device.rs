//! Finding a GPU, compiling the kernels for it, and device memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream};

use crate::nvrtc::Nvrtc;
use crate::ops::{GemvLaunch, GEMV_SHAPES, GEMV_SHAPE_ROWS, GEMV_SHAPE_TYPES};
use crate::{CudaError, Result};

/// The kernels' source, compiled by NVRTC at [`Device::open`].
const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the source defines, loaded at [`Device::open`] (with the Q8_1 GEMVs, one per
/// weight type and batch size, from [`q8_gemv_kernels`]).
const KERNELS: &[&str] = &[
    "quantize_q8_1",
    "gemv_f32",
    "gemv_f16",
    "gemv_q4_0",
    "gemv_q4_1",
    "gemv_q5_0",
    "gemv_q5_1",
    "gemv_q8_0",
    "gemv_q4_k",
    "gemv_q5_k",
    "gemv_q6_k",
    "dequant_f16_f32",
    "dequant_f16_f16",
    "dequant_f16_q4_0",
    "dequant_f16_q4_1",
    "dequant_f16_q5_0",
    "dequant_f16_q5_1",
    "dequant_f16_q8_0",
    "dequant_f16_q4_k",
    "dequant_f16_q5_k",
    "dequant_f16_q6_k",
    "f32_to_f16",
    "rms_norm",
    "add_bias",
    "add",
    "swiglu",
    "rope",
    "rope_qk",
    "rms_norm_q8",
    "add_rms_norm_q8",
    "swiglu_q8",
    "kv_store",
    "kv_import",
    "attention",
    "attention_decode",
    "attention_decode_many",
    "kv_store_many",
    "attention_combine",
    "heads_to_f16",
    "heads_from",
    "softmax_masked",
];

/// One GPU as the placement planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor): (9, 0) is Hopper.
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl DeviceInfo {
    /// "cuda:0 NVIDIA H100 80GB HBM3 (sm_90, 79.1 of 79.6 GiB free)".
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "cuda:{} {} (sm_{}{}, {:.1} of {:.1} GiB free)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            gib(self.free_bytes),
            gib(self.total_bytes)
        )
    }
}

/// Lists the GPUs, or says why there are none. Checks that the driver library can be opened
/// before calling into it (cudarc's dynamic loading panics on a missing library), then that an
/// NVRTC the driver can load the output of ([`Nvrtc::find`]) and cuBLAS can be opened too, since
/// the forward pass needs both.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    let driver = driver_version()?;
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("no device count: {e}")))?;
    if count <= 0 {
        return Err(CudaError::Unavailable(
            "the driver reports no CUDA device".into(),
        ));
    }
    Nvrtc::find(Some(driver))?;
    // SAFETY: only tries to dlopen cuBLAS by its usual names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "libcublas.so.11, .12 or .13 not found (the media's libcublas11, or a CUDA \
             toolkit's lib64 on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    (0..count as usize)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal)?;
            let (free, total) = ctx.mem_get_info()?;
            Ok(DeviceInfo {
                ordinal,
                name: ctx.name()?,
                compute_capability: ctx.compute_capability()?,
                total_bytes: total as u64,
                free_bytes: free as u64,
            })
        })
        .collect()
}

/// The CUDA the GPU path runs on, for the log and `/readyz`: "driver CUDA 12.2, NVRTC 11.8
/// (libnvrtc.so.11.2)".
pub fn runtime() -> Result<String> {
    let driver = driver_version()?;
    let nvrtc = Nvrtc::find(Some(driver))?;
    Ok(format!(
        "driver CUDA {}, {}",
        crate::nvrtc::cuda_version(driver),
        nvrtc.describe()
    ))
}

/// The driver's CUDA version (12020 for CUDA 12.2), after initialising it; an error when there
/// is no driver library or it does not initialise.
pub fn driver_version() -> Result<i32> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "libcuda.so (the NVIDIA driver) not found".into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e}")))?;
    let mut version = 0;
    // SAFETY: one out-parameter; cuDriverGetVersion is in every driver.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| CudaError::Unavailable(format!("cuDriverGetVersion failed: {e}")))?;
    Ok(version)
}

/// The two queues of a [`Device`]. Work on one lane runs in order; the lanes run side by side
/// and meet only at [`Event`]s ([`Device::wait_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The forward pass: every kernel and copy unless a call names the other lane.
    Compute,
    /// Host-to-device copies of stored KV (and the kernels placing it), so that they overlap
    /// the compute lane's work.
    Copy,
}

/// A point in one lane's work ([`Device::record`]): another lane can wait for it, and two
/// timed events give the device time between them.
pub struct Event(CudaEvent);

impl Event {
    /// Milliseconds of device time from `earlier` to this event, once both have happened
    /// (waits for them). Both must have been recorded with timing.
    pub fn ms_since(&self, earlier: &Event) -> Result<f32> {
        // cudarc's elapsed_ms calls cuEventElapsedTime_v2, which drivers before CUDA 12.8 (the
        // 535 of Debian 12 among them) lack: a missing symbol is a panic there. The first
        // version is in every driver and means the same for events that have completed.
        type ElapsedTime =
            unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;
        static ELAPSED: OnceLock<std::result::Result<ElapsedTime, String>> = OnceLock::new();
        let elapsed = ELAPSED.get_or_init(|| {
            // SAFETY: the driver library is open (an Event exists); the symbol has this
            // signature in every CUDA release.
            unsafe { sys::culib().get::<ElapsedTime>(b"cuEventElapsedTime") }
                .map(|f| *f)
                .map_err(|e| e.to_string())
        });
        let elapsed = elapsed
            .as_ref()
            .map_err(|e| CudaError::Driver(format!("cuEventElapsedTime: {e}")))?;
        earlier.0.synchronize()?;
        self.0.synchronize()?;
        let mut ms = 0.0f32;
        // SAFETY: two live events of one context, both completed (synchronized above).
        unsafe { elapsed(&mut ms, earlier.0.cu_event(), self.0.cu_event()) }.result()?;
        Ok(ms)
    }
}

/// Work captured from the compute lane ([`Device::begin_capture`], [`Device::end_capture`]):
/// replayed by [`Device::launch_graph`] as one launch, with the same kernels and arguments.
pub struct Graph(CudaGraph);

/// An open GPU: its context, the compute lane's stream every operation is queued on (so they
/// run in order), a second stream for copies that overlap it ([`Lane::Copy`]), the compiled
/// kernels and a cuBLAS handle on the compute stream.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    funcs: HashMap<String, CudaFunction>,
    info: DeviceInfo,
    compile_seconds: f64,
    compiler: String,
    multiprocessors: usize,
    pub(crate) gemv_launch: GemvLaunch,
}

impl Device {
    /// Opens GPU `ordinal` and loads the kernels: from `cache_dir` when a PTX compiled from this
    /// exact source for this architecture is there, else compiled by NVRTC and stored there
    /// (written to a temporary name and renamed, so a crash never leaves half a file).
    pub fn open(ordinal: usize, cache_dir: Option<&Path>) -> Result<Device> {
        let infos = probe()?;
        let info = infos
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| CudaError::Unavailable(format!("no CUDA device {ordinal}")))?;
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let nvrtc = Nvrtc::find(Some(driver_version()?))?;
        let (major, minor) = info.compute_capability;
        let arch = nvrtc.arch_for(major, minor)?;
        let start = std::time::Instant::now();
        let ptx = load_or_compile(&nvrtc, &arch, cache_dir)?;
        let compile_seconds = start.elapsed().as_secs_f64();
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
        let mut funcs = HashMap::new();
        for name in KERNELS
            .iter()
            .map(|k| k.to_string())
            .chain(q8_gemv_kernels())
        {
            let f = module.load_function(&name)?;
            funcs.insert(name, f);
        }
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        Ok(Device {
            ctx,
            stream,
            copy,
            blas,
            funcs,
            info,
            compile_seconds,
            compiler: format!("{}, PTX for {arch}", nvrtc.describe()),
            multiprocessors,
            gemv_launch: GemvLaunch::default(),
        })
    }

    /// What the device reported when it was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// What compiled the kernels: "NVRTC 11.8 (libnvrtc.so.11.2), PTX for compute_90".
    pub fn compiler(&self) -> &str {
        &self.compiler
    }

    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// Launches the decode GEMVs this way from now on (benchmarks compare block shapes).
    pub fn set_gemv_launch(&mut self, launch: GemvLaunch) {
        self.gemv_launch = launch;
    }

    /// Seconds spent loading (or compiling) the kernels at open.
    pub fn compile_seconds(&self) -> f64 {
        self.compile_seconds
    }

    /// (free, total) device memory now, in bytes.
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((free as u64, total as u64))
    }

    /// The stream of `lane`.
    pub(crate) fn lane(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Compute => &self.stream,
            Lane::Copy => &self.copy,
        }
    }

    /// Records the work queued on `lane` so far: an [`Event`] other lanes can wait for, and,
    /// with `timed`, one whose time [`Event::ms_since`] can read.
    pub fn record(&self, lane: Lane, timed: bool) -> Result<Event> {
        let flags = if timed {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        Ok(Event(self.lane(lane).record_event(Some(flags))?))
    }

    /// Makes the work queued on `lane` from now on wait until `event` has happened; returns at
    /// once.
    pub fn wait_for(&self, lane: Lane, event: &Event) -> Result<()> {
        self.lane(lane).wait(&event.0)?;
        Ok(())
    }

    /// Starts recording the compute lane's work into a graph instead of running it: until
    /// [`Device::end_capture`], launches and device copies are recorded, and nothing may wait
    /// for the device or copy from host memory on that lane.
    pub fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        Ok(())
    }

    /// Ends the recording [`Device::begin_capture`] started (always call it once begun, also
    /// when queuing the work failed) and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph> {
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))?
            .ok_or_else(|| CudaError::Driver("an empty graph was captured".into()))?;
        Ok(Graph(graph))
    }

    /// Queues a captured graph on the compute lane.
    pub fn launch_graph(&self, graph: &Graph) -> Result<()> {
        graph.0.launch()?;
        Ok(())
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel `{name}` loaded")))
    }

    /// `bytes` of uninitialised device memory.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a plain allocation in the bound context; freed once by `Buffer::drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }?;
        Ok(Buffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// A device copy of `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<Buffer> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        self.write(&buf, 0, data)?;
        Ok(buf)
    }

    /// Copies `data` into `buf` at byte `offset`, queued on the compute lane. The host memory
    /// is pageable, so the call returns once the driver has staged it: `data` may be dropped.
    pub fn write<T: Copy>(&self, buf: &Buffer, offset: usize, data: &[T]) -> Result<()> {
        self.write_on(Lane::Compute, buf, offset, data)
    }

    /// [`Device::write`] queued on `lane`.
    pub fn write_on<T: Copy>(
        &self,
        lane: Lane,
        buf: &Buffer,
        offset: usize,
        data: &[T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        buf.check(offset, bytes, "write")?;
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the destination range lies inside `buf` (checked above); pageable source
        // memory is staged before the call returns.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                buf.ptr + offset as u64,
                data,
                self.lane(lane).cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Copies `out.len()` values from `buf` at byte `offset` after everything queued before.
    pub fn read<T: Copy>(&self, buf: &Buffer, offset: usize, out: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        buf.check(offset, bytes, "read")?;
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the source range lies inside `buf`; a copy to pageable memory returns once
        // it is complete, so `out` holds the data when this returns.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                out,
                buf.ptr + offset as u64,
                self.stream.cu_stream(),
            )
        }?;
        self.synchronize()
    }

    /// Copies `bytes` from `src` at `src_offset` to `dst` at `dst_offset` on the device.
    pub fn copy(
        &self,
        src: &Buffer,
        src_offset: usize,
        dst: &Buffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        src.check(src_offset, bytes, "device copy from")?;
        dst.check(dst_offset, bytes, "device copy to")?;
        self.ctx.bind_to_thread()?;
        // SAFETY: both ranges are inside their buffers (checked above).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.ptr + dst_offset as u64,
                src.ptr + src_offset as u64,
                bytes,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Waits until everything queued on both lanes has run.
    pub fn synchronize(&self) -> Result<()> {
        self.copy.synchronize()?;
        self.stream.synchronize()?;
        Ok(())
    }
}

/// Page-locked host memory: copies from it to the device run asynchronously at the bus's full
/// rate (stored chunk KV staged for upload). Freed on drop, after the device has finished
/// every queued copy; [`Pinned::bytes_mut`] also waits for them first, so a copy in flight never
/// sees its source change.
pub struct Pinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl Pinned {
    /// The memory, to read.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live page-locked allocation of `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory, to fill, once every queued copy from it has finished.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.ctx.bind_to_thread()?;
        self.ctx.synchronize()?;
        // SAFETY: as in `bytes`, and no copy from it is in flight (synchronised above).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            // SAFETY: `ptr` came from `malloc_host` and is freed exactly once, here, after the
            // device finished every queued copy from it.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
        }
    }
}

impl Device {
    /// `bytes` of zeroed page-locked host memory.
    pub fn pinned(&self, bytes: usize) -> Result<Pinned> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a plain page-locked allocation, freed once by `Pinned::drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes.max(1), 0) }?.cast::<u8>();
        // SAFETY: the allocation holds at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(Pinned {
            ptr,
            len: bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// Queues a copy of `bytes` from `src` at `src_offset` to `dst` at `dst_offset` on the
    /// compute lane; returns at once (the DMA runs while the device computes).
    pub fn write_pinned(
        &self,
        dst: &Buffer,
        dst_offset: usize,
        src: &Pinned,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        self.write_pinned_on(Lane::Compute, dst, dst_offset, src, src_offset, bytes)
    }

    /// [`Device::write_pinned`] queued on `lane`.
    pub fn write_pinned_on(
        &self,
        lane: Lane,
        dst: &Buffer,
        dst_offset: usize,
        src: &Pinned,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        dst.check(dst_offset, bytes, "pinned copy to")?;
        if src_offset + bytes > src.len {
            return Err(CudaError::Driver("pinned copy past its host buffer".into()));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: both ranges are inside their allocations (checked above); the source stays
        // allocated and unchanged until the copy ran, since `Pinned` waits for the device
        // before it is freed or handed out for writing.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.ptr + dst_offset as u64,
                &src.bytes()[src_offset..src_offset + bytes],
                self.lane(lane).cu_stream(),
            )
        }?;
        Ok(())
    }
}

/// Device memory owned by one allocation; freed on drop.
pub struct Buffer {
    pub(crate) ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl Buffer {
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// An error unless `bytes` bytes from `offset` lie inside the buffer.
    fn check(&self, offset: usize, bytes: usize, what: &str) -> Result<()> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.bytes) {
            return Err(CudaError::Driver(format!(
                "{what} of {bytes} bytes at {offset} past a {}-byte buffer",
                self.bytes
            )));
        }
        Ok(())
    }

    /// The buffer's device address: what a captured graph's launches hold on to.
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// The device address `offset` bytes in (for kernel arguments).
    pub(crate) fn at(&self, offset: usize) -> sys::CUdeviceptr {
        engram_kernels::guard!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Work still queued on the buffer must finish first: synchronise the context.
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` and is freed exactly once, here.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

/// The Q8_1 GEMV kernels: `gemv_q8_{type}_{rows}` for every quantised type and 1..=8 rows,
/// and `gemv_q8_{type}_{rows}_{shape}` for the other block shapes.
fn q8_gemv_kernels() -> impl Iterator<Item = String> {
    let default = [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
    ]
    .into_iter()
    .flat_map(|t| (1..=crate::MAX_GEMV_BATCH).map(move |n| format!("gemv_q8_{t}_{n}")));
    let shaped = GEMV_SHAPE_TYPES.iter().flat_map(|t| {
        GEMV_SHAPE_ROWS.iter().flat_map(move |n| {
            GEMV_SHAPES
                .iter()
                .map(move |(shape, _, _)| format!("gemv_q8_{t}_{n}_{shape}"))
        })
    });
    default.chain(shaped)
}

fn cache_path(dir: &Path, nvrtc: &Nvrtc, arch: &str) -> PathBuf {
    let hash = xxhash_rust::xxh3::xxh3_64(SOURCE.as_bytes());
    let (major, minor) = nvrtc.version();
    dir.join(format!(
        "engram-kernels-{hash:016x}-{arch}-nvrtc{major}.{minor}.ptx"
    ))
}

/// Compiles the kernels to PTX for `arch` (`compute_90`, ...) with the newest NVRTC found (no
/// driver or GPU is needed, so the build machines check that the CUDA source compiles).
pub fn compile_ptx(arch: &str) -> Result<String> {
    compile_ptx_with(&*Nvrtc::find(None)?, arch)
}

/// [`compile_ptx`] with a given NVRTC (the tests compile with each one the media may use).
pub fn compile_ptx_with(nvrtc: &Nvrtc, arch: &str) -> Result<String> {
    load_or_compile(nvrtc, arch, None)
}

fn load_or_compile(nvrtc: &Nvrtc, arch: &str, cache_dir: Option<&Path>) -> Result<String> {
    if let Some(dir) = cache_dir {
        if let Ok(ptx) = std::fs::read_to_string(cache_path(dir, nvrtc, arch)) {
            if ptx.contains(".entry") {
                return Ok(ptx);
            }
        }
    }
    let options = [format!("--gpu-architecture={arch}"), "-std=c++17".into()];
    let ptx = nvrtc.compile(SOURCE, "kernels.cu", &options)?;
    if let Some(dir) = cache_dir {
        let path = cache_path(dir, nvrtc, arch);
        let tmp = path.with_extension("ptx.tmp");
        // A cache that cannot be written only costs the next start a compile.
        if std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

impl Device {
    /// The device-to-device copy rate in GB/s (bytes read plus bytes written, as STREAM's copy
    /// counts them): the practical ceiling of a memory-bound kernel. Best of `passes` copies of
    /// `bytes`.
    pub fn copy_bandwidth(&self, bytes: usize, passes: usize) -> Result<f64> {
        let src = self.alloc(bytes)?;
        let dst = self.alloc(bytes)?;
        self.copy(&src, 0, &dst, 0, bytes)?;
        self.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..passes.max(1) {
            let start = std::time::Instant::now();
            self.copy(&src, 0, &dst, 0, bytes)?;
            self.synchronize()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(2.0 * bytes as f64 / best / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a driver (the build machines) the answer is a reason, never a
    /// panic; with one, every device is listed with its memory.
    #[test]
    fn probe_lists_devices_or_says_why_not() {
        match probe() {
            Ok(devices) => {
                assert!(!devices.is_empty());
                for d in devices {
                    assert!(d.total_bytes > 0 && d.free_bytes <= d.total_bytes, "{d:?}");
                    assert!(d.describe().starts_with(&format!("cuda:{}", d.ordinal)));
                }
            }
            Err(CudaError::Unavailable(why)) => {
                assert!(!why.is_empty());
                assert!(matches!(
                    Device::open(0, None),
                    Err(CudaError::Unavailable(_))
                ));
            }
            Err(e) => panic!("probe failed with {e} instead of listing or explaining"),
        }
    }

    /// Every kernel the source defines is loaded at open, and every name loaded is defined (a
    /// kernel missing from the list would only fail on a GPU, at its first launch).
    #[test]
    fn every_kernel_of_the_source_is_loaded() {
        use std::collections::BTreeSet;
        let mut defined = BTreeSet::new();
        for line in SOURCE.lines().map(str::trim_start) {
            if let Some(rest) = line.strip_prefix("extern \"C\" __global__ void ") {
                let name = rest.split('(').next().unwrap_or("").trim();
                // Macro bodies (`gemv_q8_##name`) define their kernels through the calls below.
                if !rest.contains("##") {
                    defined.insert(name.to_string());
                }
            }
            // The macro instantiations: INSTANTIATE(name, T), GEMV_Q8_ALL(name, T).
            let arg = |prefix: &str| {
                line.strip_prefix(prefix)
                    .and_then(|r| r.split(',').next())
                    .map(str::to_string)
            };
            if let Some(name) = arg("INSTANTIATE(") {
                defined.insert(format!("gemv_{name}"));
                defined.insert(format!("dequant_f16_{name}"));
            }
            if let Some(name) = arg("GEMV_Q8_ALL(") {
                for n in 1..=crate::MAX_GEMV_BATCH {
                    defined.insert(format!("gemv_q8_{name}_{n}"));
                }
            }
            if let Some(name) = arg("GEMV_Q8_SHAPES(") {
                for n in GEMV_SHAPE_ROWS {
                    for (shape, _, _) in GEMV_SHAPES {
                        defined.insert(format!("gemv_q8_{name}_{n}_{shape}"));
                    }
                }
            }
        }
        let loaded: BTreeSet<String> = KERNELS
            .iter()
            .map(|k| k.to_string())
            .chain(q8_gemv_kernels())
            .collect();
        assert_eq!(defined, loaded);
    }

    /// `Device::write_seq_table` writes what the kernels' `SeqCache` holds: three device
    /// pointers, then four 32-bit ints, SEQ_TABLE_ENTRY bytes in all.
    #[test]
    fn the_sequence_table_matches_the_kernels_struct() {
        let start = SOURCE
            .find("struct SeqCache {")
            .expect("SeqCache in the source");
        let body = &SOURCE[start..start + SOURCE[start..].find("};").expect("its end")];
        let fields: Vec<&str> = body
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| l.split(';').next().unwrap_or(""))
            .collect();
        let pointers = fields.iter().filter(|f| f.contains('*')).count();
        let ints = fields.iter().filter(|f| f.starts_with("int ")).count();
        assert_eq!((pointers, ints, fields.len()), (3, 4, 7), "{fields:?}");
        assert_eq!(pointers * 8 + ints * 4, crate::SEQ_TABLE_ENTRY);
        assert!(
            fields[..3].iter().all(|f| f.contains('*')),
            "pointers first: {fields:?}"
        );
    }

    #[test]
    fn describe_names_the_device_and_its_memory() {
        let d = DeviceInfo {
            ordinal: 1,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_bytes: 80 << 30,
            free_bytes: 79 << 30,
        };
        assert_eq!(
            d.describe(),
            "cuda:1 NVIDIA H100 80GB HBM3 (sm_90, 79.0 of 80.0 GiB free)"
        );
    }
}
