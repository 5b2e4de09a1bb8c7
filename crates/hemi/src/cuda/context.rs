//! The CUDA device context: one stream, a cuBLAS handle, the caching allocator and the
//! compiled-module cache; and [`CudaStorage`], a typed buffer in that allocator.
//!
//! This is the layer the tensor backend will call; it is not wired into `Tensor` yet. Only
//! runs with a GPU; [`CudaDevice::new`] checks for the libraries and the device first and
//! returns an error (never a panic) when either is missing.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::CompileOptions;
use half::{bf16, f16};

use super::alloc::{BlockHandle, CachingAllocator, MemoryStats, RawAllocator};
use super::device::{check_device, NVRTC};
use super::gemm::{map_gemm, GemmArgs, GemmType, MatView, Op};
use super::kernels::{module_key, module_source, BinaryOp, IndexParams, Kernel, ReduceOp, UnaryOp};
use super::launch::{self, LaunchDims};
use crate::dtype::DType;
use crate::error::{Error, Result};

// SAFETY: `IndexParams` is `repr(C)`, plain 64-bit integers, laid out as `struct HemiIndex`.
unsafe impl DeviceRepr for IndexParams {}

fn drv_err(op: &'static str) -> impl Fn(drv::DriverError) -> Error {
    move |e| Error::device(op, format!("CUDA driver error {e:?}"))
}

/// `cuMemAlloc`/`cuMemFree` in the device's context.
struct DriverRaw {
    ctx: Arc<CudaContext>,
}

impl RawAllocator for DriverRaw {
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64> {
        self.ctx.bind_to_thread().map_err(drv_err("cuda malloc"))?;
        // SAFETY: the context is current; the memory is only used through the allocator.
        unsafe { drv::malloc_sync(bytes) }.map_err(drv_err("cuda malloc"))
    }

    fn raw_free(&mut self, ptr: u64) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv_err("cuda free"))?;
        // Blocks are reused in stream order, but a segment handed back must be idle.
        self.ctx.synchronize().map_err(drv_err("cuda free"))?;
        // SAFETY: `ptr` came from `raw_alloc` and the allocator frees it once.
        unsafe { drv::free_sync(ptr) }.map_err(drv_err("cuda free"))
    }
}

/// One GPU: context, stream, cuBLAS, allocator, kernels. Share it as `Arc<CudaDevice>`.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    alloc: Mutex<CachingAllocator<DriverRaw>>,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    arch: Option<&'static str>,
}

// The raw handles inside are used behind the mutexes or on the one stream; cudarc's own
// types are Send + Sync.
impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Every storage holds an Arc of the device, so all blocks are free by now: hand the
        // cached segments back to the driver instead of leaking them into the primary context.
        let _ = self.stream.synchronize();
        if let Ok(mut a) = self.alloc.lock() {
            let _ = a.empty_cache();
        }
    }
}

/// A buffer on a GPU: an allocator block, its dtype and element count, the device.
#[derive(Debug)]
pub struct CudaStorage {
    block: BlockHandle,
    dtype: DType,
    len: usize,
    device: Arc<CudaDevice>,
}

impl CudaStorage {
    /// The dtype of every element.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The ordinal `n` of the GPU (`cuda:n`) holding the buffer.
    pub fn ordinal(&self) -> usize {
        self.device.ordinal
    }
    /// The device (context, stream, allocator) that owns the buffer.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    /// The device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.block.ptr
    }
    /// The buffer's size in bytes (elements × the dtype's size).
    pub fn num_bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        // Stream-ordered reuse: the block goes back to the stream's pool; later work on the
        // same stream runs after every kernel already queued on it.
        if let Ok(mut a) = self.device.alloc.lock() {
            let _ = a.free(self.block);
        }
    }
}

/// NVRTC's virtual architecture (`compute_XY`) for compute capability `major.minor`, or
/// `None` for one NVRTC 13 cannot target: CUDA 13 dropped Maxwell, Pascal and Volta
/// (compute 7.0 and below; NVRTC 13 rejects `compute_70`), and a capability newer than this
/// list is unknown here.
#[doc(hidden)]
pub fn nvrtc_arch(major: i32, minor: i32) -> Option<&'static str> {
    NVRTC_ARCHS
        .iter()
        .find(|&&(ma, mi, _)| (ma, mi) == (major, minor))
        .map(|&(_, _, name)| name)
}

/// Every compute capability hemi compiles its kernels for, with NVRTC's name for it:
/// Turing (7.5) to Blackwell (12.x). `tests/cuda` compiles every module for each with the
/// real NVRTC (CI installs it from PyPI).
#[doc(hidden)]
pub const NVRTC_ARCHS: [(i32, i32, &str); 11] = [
    (7, 5, "compute_75"),
    (8, 0, "compute_80"),
    (8, 6, "compute_86"),
    (8, 7, "compute_87"),
    (8, 9, "compute_89"),
    (9, 0, "compute_90"),
    (10, 0, "compute_100"),
    (10, 3, "compute_103"),
    (11, 0, "compute_110"),
    (12, 0, "compute_120"),
    (12, 1, "compute_121"),
];

/// Compiles the generated module of `dtype` for `arch` (`compute_XY`) with NVRTC, without a
/// GPU: Ok with NVRTC's log (empty when it had nothing to say), or an error with the log.
/// What `CudaDevice::function` does before loading, exposed so that tests and CI check every
/// module for every architecture on machines with NVRTC and no GPU.
#[doc(hidden)]
pub fn compile_module(dtype: DType, arch: &'static str) -> Result<String> {
    use cudarc::nvrtc::result as nvrtc;
    NVRTC.probe()?;
    let src = module_source(dtype)?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(include_dirs().iter().map(|d| format!("--include-path={d}")));
    let what = format!("{dtype:?} module for {arch}");
    let err = |e: String| Error::device("nvrtc", format!("{what}: {e}"));
    let name =
        std::ffi::CString::new(format!("hemi_{dtype:?}.cu")).map_err(|e| err(e.to_string()))?;
    let program = nvrtc::create_program(
        std::ffi::CString::new(src)
            .map_err(|e| err(e.to_string()))?
            .as_c_str(),
        Some(name.as_c_str()),
    )
    .map_err(|e| err(format!("{e:?}")))?;
    // SAFETY: `program` was just created and is destroyed once, below.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(program) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).trim().to_string()
        })
        .unwrap_or_default();
    // SAFETY: as above.
    let _ = unsafe { nvrtc::destroy_program(program) };
    match compiled {
        Ok(()) => Ok(log),
        Err(e) => Err(err(format!(
            "{e:?}: {log}. If cuda_fp16.h was not found, set HEMI_CUDA_INCLUDE or CUDA_HOME \
             to a CUDA include dir, or put the nvidia-cuda-runtime wheel's lib dir on \
             LD_LIBRARY_PATH"
        ))),
    }
}

/// Directories searched for `cuda_fp16.h`/`cuda_bf16.h` when compiling kernels:
/// `HEMI_CUDA_INCLUDE` (a `:`-separated list), then `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, `/usr/local/cuda/include`, then the headers of NVIDIA's PyPI wheels
/// (`nvidia-cuda-runtime` keeps them in `nvidia/cu13/include`, beside the `lib` dir that
/// `LD_LIBRARY_PATH` names so that NVRTC loads): `DIR/../include` for each `LD_LIBRARY_PATH`
/// entry, and the active virtual environment's (`$VIRTUAL_ENV`) site-packages; those that
/// exist.
pub fn include_dirs() -> Vec<String> {
    let var = |k: &str| std::env::var(k).ok();
    let mut dirs = include_dirs_from(var("HEMI_CUDA_INCLUDE"), var("CUDA_HOME"), var("CUDA_PATH"));
    for d in wheel_include_dirs(var("LD_LIBRARY_PATH"), var("VIRTUAL_ENV")) {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

/// The wheel-installed CUDA include dirs `include_dirs` adds (testable without touching the
/// environment): `DIR/../include` for each `ld_library_path` entry, and
/// `VENV/lib/python3.*/site-packages/nvidia/cu13/include`; those holding `cuda_fp16.h`.
#[doc(hidden)]
pub fn wheel_include_dirs(ld_library_path: Option<String>, venv: Option<String>) -> Vec<String> {
    use std::path::{Path, PathBuf};
    let mut found: Vec<PathBuf> = Vec::new();
    for lib in ld_library_path
        .iter()
        .flat_map(|v| v.split(':'))
        .filter(|s| !s.is_empty())
    {
        found.push(Path::new(lib).join("..").join("include"));
    }
    if let Some(venv) = venv {
        if let Ok(entries) = std::fs::read_dir(Path::new(&venv).join("lib")) {
            let mut pys: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            pys.sort();
            for py in pys {
                found.push(py.join("site-packages/nvidia/cu13/include"));
            }
        }
    }
    let mut out: Vec<String> = Vec::new();
    for d in found {
        if d.join("cuda_fp16.h").exists() {
            let d = d.canonicalize().unwrap_or(d).display().to_string();
            if !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out
}

/// [`include_dirs`] from given variable values (testable without touching the environment).
#[doc(hidden)]
pub fn include_dirs_from(
    hemi: Option<String>,
    cuda_home: Option<String>,
    cuda_path: Option<String>,
) -> Vec<String> {
    let mut dirs: Vec<String> = Vec::new();
    if let Some(v) = hemi {
        dirs.extend(v.split(':').filter(|s| !s.is_empty()).map(String::from));
    }
    for v in [cuda_home, cuda_path].into_iter().flatten() {
        dirs.push(format!("{v}/include"));
    }
    dirs.push("/usr/local/cuda/include".into());
    dirs.retain(|d| std::path::Path::new(d).join("cuda_fp16.h").exists());
    // CUDA 13 keeps the CCCL headers (<nv/target>, which cuda_fp16.h may include) in cccl/.
    let mut all = Vec::new();
    for d in dirs {
        let cccl = format!("{d}/cccl");
        let has_cccl = std::path::Path::new(&cccl).is_dir();
        if !all.contains(&d) {
            all.push(d);
        }
        if has_cccl && !all.contains(&cccl) {
            all.push(cccl);
        }
    }
    all
}

/// Errors unless a view reading up to `max_offset` fits in `s` (nothing is read when empty).
fn check_bounds(
    op: &'static str,
    name: &str,
    max_offset: i64,
    numel: i64,
    s: &CudaStorage,
) -> Result<()> {
    if numel > 0 && max_offset as u64 >= s.len as u64 {
        return Err(Error::arg(
            op,
            format!(
                "{name} reads up to element {max_offset} of a {}-element storage",
                s.len
            ),
        ));
    }
    Ok(())
}

fn to_cfg(d: LaunchDims) -> LaunchConfig {
    LaunchConfig {
        grid_dim: d.grid,
        block_dim: d.block,
        shared_mem_bytes: d.shared_mem_bytes,
    }
}

fn blas_type(t: GemmType) -> blas_sys::cudaDataType {
    match t {
        GemmType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        GemmType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
        GemmType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
    }
}

fn blas_op(o: Op) -> blas_sys::cublasOperation_t {
    match o {
        Op::N => blas_sys::cublasOperation_t::CUBLAS_OP_N,
        Op::T => blas_sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: checks the libraries and the ordinal (errors name what is
    /// missing), then creates the context, a stream and the cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>> {
        check_device(ordinal)?;
        let op = "cuda device";
        let ctx = CudaContext::new(ordinal).map_err(drv_err(op))?;
        let stream = ctx.new_stream().map_err(drv_err(op))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::device(op, format!("cuBLAS handle: {e:?}")))?;
        let (ma, mi) = ctx.compute_capability().map_err(drv_err(op))?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            alloc: Mutex::new(CachingAllocator::new(DriverRaw { ctx: ctx.clone() })),
            ctx,
            stream,
            blas,
            modules: Mutex::new(HashMap::new()),
            arch: nvrtc_arch(ma, mi),
        }))
    }

    /// The GPU's ordinal `n` (`cuda:n`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name (e.g. "NVIDIA H200").
    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(drv_err("cuda device"))
    }

    /// Makes the context current on this thread (raw driver and cuBLAS calls need it; any
    /// thread may use the device).
    fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv_err(op))
    }

    fn stream_id(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv_err("cuda synchronize"))
    }

    /// The caching allocator's counters for this device (`torch.cuda.memory_stats`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.alloc.lock().map(|a| a.stats()).unwrap_or_default()
    }

    /// Returns every wholly free cached segment to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        self.lock_alloc()?.empty_cache()
    }

    fn lock_alloc(&self) -> Result<std::sync::MutexGuard<'_, CachingAllocator<DriverRaw>>> {
        self.alloc
            .lock()
            .map_err(|_| Error::device("cuda malloc", "allocator lock poisoned by a panic"))
    }

    /// Uninitialised storage for `len` elements of `dtype`.
    pub fn alloc(self: &Arc<Self>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::device("cuda malloc", format!("{len} x {dtype:?} overflows")))?;
        let block = self.lock_alloc()?.malloc(bytes, self.stream_id())?;
        Ok(CudaStorage {
            block,
            dtype,
            len,
            device: self.clone(),
        })
    }

    /// Zero-filled storage (an async memset on the stream).
    pub fn zeros(self: &Arc<Self>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let s = self.alloc(dtype, len)?;
        self.bind("cuda zeros")?;
        if s.num_bytes() > 0 {
            // SAFETY: the block holds at least num_bytes; the stream orders later uses.
            unsafe {
                drv::memset_d8_async(s.device_ptr(), 0, s.num_bytes(), self.stream.cu_stream())
            }
            .map_err(drv_err("cuda zeros"))?;
        }
        Ok(s)
    }

    /// Copies host bytes (`dtype`'s little-endian encoding) to new device storage: staged
    /// through pinned memory and copied asynchronously on the stream; the call waits for the
    /// copy before it releases the staging buffer.
    pub fn upload_bytes(self: &Arc<Self>, dtype: DType, bytes: &[u8]) -> Result<CudaStorage> {
        let es = dtype.size_in_bytes();
        if !bytes.len().is_multiple_of(es) {
            return Err(Error::arg(
                "cuda upload",
                format!(
                    "{} bytes is not a whole number of {dtype:?} elements",
                    bytes.len()
                ),
            ));
        }
        let s = self.alloc(dtype, bytes.len() / es)?;
        if bytes.is_empty() {
            return Ok(s);
        }
        let op = "cuda upload";
        self.bind(op)?;
        // SAFETY: the pinned buffer is fully written before the copy reads it.
        let mut pinned =
            unsafe { self.ctx.alloc_pinned::<u8>(bytes.len()) }.map_err(drv_err(op))?;
        pinned
            .as_mut_slice()
            .map_err(drv_err(op))?
            .copy_from_slice(bytes);
        let src = pinned.as_slice().map_err(drv_err(op))?;
        // SAFETY: the destination holds bytes.len() bytes; we synchronise before `pinned`
        // is dropped.
        unsafe { drv::memcpy_htod_async(s.device_ptr(), src, self.stream.cu_stream()) }
            .map_err(drv_err(op))?;
        self.synchronize()?;
        Ok(s)
    }

    /// Copies device storage back to host bytes (through pinned memory; waits).
    pub fn download_bytes(&self, s: &CudaStorage) -> Result<Vec<u8>> {
        let n = s.num_bytes();
        if n == 0 {
            return Ok(Vec::new());
        }
        let op = "cuda download";
        self.bind(op)?;
        // Not write-combined: the host reads it.
        let mut pinned =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(n, 0) }.map_err(drv_err(op))?;
        {
            let dst = pinned.as_mut_slice().map_err(drv_err(op))?;
            // SAFETY: both hold n bytes; synchronised below before reading.
            unsafe { drv::memcpy_dtoh_async(dst, s.device_ptr(), self.stream.cu_stream()) }
                .map_err(drv_err(op))?;
        }
        self.synchronize()?;
        Ok(pinned.as_slice().map_err(drv_err(op))?.to_vec())
    }

    /// Uploads f32 values as `dtype` (rounded to nearest even on the host).
    pub fn upload_f32(self: &Arc<Self>, values: &[f32], dtype: DType) -> Result<CudaStorage> {
        let bytes: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            d => return Err(Error::dtype("cuda upload", d, "F16, BF16 or F32 only")),
        };
        self.upload_bytes(dtype, &bytes)
    }

    /// Downloads storage as f32 values (exact for every supported dtype).
    pub fn download_f32(&self, s: &CudaStorage) -> Result<Vec<f32>> {
        let b = self.download_bytes(s)?;
        Ok(match s.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => return Err(Error::dtype("cuda download", d, "F16, BF16 or F32 only")),
        })
    }

    fn check_mine(&self, op: &'static str, s: &CudaStorage) -> Result<()> {
        if !std::ptr::eq(s.device.as_ref(), self) {
            return Err(Error::device(
                op,
                format!(
                    "storage on cuda:{} used with cuda:{}",
                    s.ordinal(),
                    self.ordinal
                ),
            ));
        }
        Ok(())
    }

    /// The compiled function `kernel` for storage dtype `dtype`, compiling (NVRTC) and
    /// loading the dtype's module on first use.
    pub fn function(&self, kernel: Kernel, dtype: DType) -> Result<CudaFunction> {
        let name = kernel.name(dtype)?;
        let src = module_source(dtype)?;
        let arch = self.arch.unwrap_or("default");
        let includes = include_dirs();
        let options: Vec<String> = includes.iter().map(|d| format!("-I{d}")).collect();
        let key = module_key(dtype, arch, &src, &options)?;
        let module = {
            let mut cache = self
                .modules
                .lock()
                .map_err(|_| Error::device("cuda kernels", "module cache lock poisoned"))?;
            match cache.get(&key) {
                Some(m) => m.clone(),
                None => {
                    NVRTC.probe()?;
                    let opts = CompileOptions {
                        arch: self.arch,
                        include_paths: includes,
                        name: Some(format!("{key}.cu")),
                        ..Default::default()
                    };
                    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| {
                        Error::device(
                            "cuda kernels",
                            format!(
                                "NVRTC failed to compile {key}: {e:?}. If cuda_fp16.h was not \
                                 found, set HEMI_CUDA_INCLUDE or CUDA_HOME to a CUDA include dir"
                            ),
                        )
                    })?;
                    let m = self.ctx.load_module(ptx).map_err(drv_err("cuda kernels"))?;
                    cache.insert(key, m.clone());
                    m
                }
            }
        };
        module.load_function(&name).map_err(|e| {
            Error::device(
                "cuda kernels",
                format!("no kernel {name} in the module: {e:?}"),
            )
        })
    }

    /// Compiles every dtype's module now (a smoke test of the generated sources).
    pub fn compile_all(&self) -> Result<()> {
        for dtype in super::kernels::DTYPES {
            for k in Kernel::all(dtype) {
                self.function(k, dtype)?;
            }
        }
        Ok(())
    }

    /// `y = op(x)` of a strided view (`shape`, `strides` in elements, offset 0) into new
    /// contiguous storage.
    pub fn unary(
        self: &Arc<Self>,
        op: UnaryOp,
        x: &CudaStorage,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<CudaStorage> {
        self.check_mine("cuda unary", x)?;
        let p = IndexParams::unary(shape, strides)?;
        check_bounds("cuda unary", "x", p.max_offsets().0, p.numel, x)?;
        let y = self.alloc(x.dtype, p.numel as usize)?;
        if let Some(d) = launch::elementwise(p.numel as u64) {
            let f = self.function(Kernel::Unary(op.name()), x.dtype)?;
            let (xp, yp) = (x.device_ptr(), y.device_ptr());
            let (c0, c1) = op.scalars();
            let (c0, c1) = (c0 as f32, c1 as f32);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&xp).arg(&yp).arg(&p).arg(&c0).arg(&c1);
            // SAFETY: the kernel's signature is (const T*, T*, HemiIndex, float, float);
            // offsets stay within the view the caller described.
            unsafe { b.launch(to_cfg(d)) }.map_err(drv_err("cuda unary"))?;
        }
        Ok(y)
    }

    /// `y = op(a, b)` with broadcasting; the output shape and storage.
    pub fn binary(
        self: &Arc<Self>,
        op: BinaryOp,
        a: (&CudaStorage, &[usize], &[isize]),
        b: (&CudaStorage, &[usize], &[isize]),
    ) -> Result<(Vec<usize>, CudaStorage)> {
        self.check_mine("cuda binary", a.0)?;
        self.check_mine("cuda binary", b.0)?;
        if a.0.dtype != b.0.dtype {
            return Err(Error::dtype(
                "cuda binary",
                b.0.dtype,
                format!("operands must share a dtype (the other is {:?})", a.0.dtype),
            ));
        }
        let (shape, p) = IndexParams::binary(a.1, a.2, b.1, b.2)?;
        let (ma, mb) = p.max_offsets();
        check_bounds("cuda binary", "a", ma, p.numel, a.0)?;
        check_bounds("cuda binary", "b", mb, p.numel, b.0)?;
        let y = self.alloc(a.0.dtype, p.numel as usize)?;
        if let Some(d) = launch::elementwise(p.numel as u64) {
            let f = self.function(Kernel::Binary(op), a.0.dtype)?;
            let (ap, bp, yp) = (a.0.device_ptr(), b.0.device_ptr(), y.device_ptr());
            let mut lb = self.stream.launch_builder(&f);
            lb.arg(&ap).arg(&bp).arg(&yp).arg(&p);
            // SAFETY: as in `unary`.
            unsafe { lb.launch(to_cfg(d)) }.map_err(drv_err("cuda binary"))?;
        }
        Ok((shape, y))
    }

    /// Converts contiguous storage to `to` (round to nearest even).
    pub fn cast(self: &Arc<Self>, x: &CudaStorage, to: DType) -> Result<CudaStorage> {
        self.check_mine("cuda cast", x)?;
        let y = self.alloc(to, x.len)?;
        if let Some(d) = launch::elementwise(x.len as u64) {
            let f = self.function(Kernel::Cast(to), x.dtype)?;
            let (xp, yp, n) = (x.device_ptr(), y.device_ptr(), x.len as u64);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&xp).arg(&yp).arg(&n);
            // SAFETY: both buffers hold n elements of their dtypes.
            unsafe { b.launch(to_cfg(d)) }.map_err(drv_err("cuda cast"))?;
        }
        Ok(y)
    }

    fn rows_kernel(
        self: &Arc<Self>,
        op: &'static str,
        x: &CudaStorage,
        rows: usize,
        cols: usize,
        out_len: usize,
        kernel: impl Fn(launch::RowStrategy) -> Kernel,
    ) -> Result<CudaStorage> {
        self.check_mine(op, x)?;
        if rows.checked_mul(cols) != Some(x.len) {
            return Err(Error::shape(
                op,
                format!("{rows} x {cols} rows over {} elements", x.len),
            ));
        }
        let y = self.alloc(x.dtype, out_len)?;
        if let Some(l) = launch::rows(rows as u64, cols as u64) {
            let f = self.function(kernel(l.strategy), x.dtype)?;
            let (xp, yp, r, c) = (x.device_ptr(), y.device_ptr(), rows as u64, cols as u64);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&xp).arg(&yp).arg(&r).arg(&c);
            // SAFETY: x holds rows*cols elements, y out_len (rows or rows*cols).
            unsafe { b.launch(to_cfg(l.dims)) }.map_err(drv_err(op))?;
        }
        Ok(y)
    }

    /// Sum or max of each row of a contiguous `rows x cols` matrix (F32 accumulation).
    pub fn reduce_rows(
        self: &Arc<Self>,
        op: ReduceOp,
        x: &CudaStorage,
        rows: usize,
        cols: usize,
    ) -> Result<CudaStorage> {
        self.rows_kernel("cuda reduce_rows", x, rows, cols, rows, |s| {
            Kernel::Reduce(op, s)
        })
    }

    /// Softmax of each row of a contiguous `rows x cols` matrix.
    pub fn softmax_rows(
        self: &Arc<Self>,
        x: &CudaStorage,
        rows: usize,
        cols: usize,
    ) -> Result<CudaStorage> {
        self.rows_kernel(
            "cuda softmax_rows",
            x,
            rows,
            cols,
            rows * cols,
            Kernel::Softmax,
        )
    }

    /// GradScaler's fused step: multiplies every grad (in place, one launch per dtype) by
    /// `inv_scale` (an F32 scalar on the device) and sets `found_inf` (an F32 scalar) to 1 if
    /// any result is not finite; `found_inf` is left alone otherwise.
    pub fn unscale_and_check_finite(
        self: &Arc<Self>,
        grads: &[&CudaStorage],
        inv_scale: &CudaStorage,
        found_inf: &CudaStorage,
    ) -> Result<()> {
        let op = "cuda unscale";
        for s in [inv_scale, found_inf] {
            self.check_mine(op, s)?;
            if s.dtype != DType::F32 || s.len != 1 {
                return Err(Error::dtype(
                    op,
                    s.dtype,
                    "inv_scale and found_inf are F32 scalars",
                ));
            }
        }
        if let Some(g) = grads
            .iter()
            .find(|g| !super::kernels::DTYPES.contains(&g.dtype))
        {
            return Err(Error::dtype(op, g.dtype, "grads must be F16, BF16 or F32"));
        }
        for g in grads {
            self.check_mine(op, g)?;
        }
        for dtype in super::kernels::DTYPES {
            let group: Vec<&CudaStorage> =
                grads.iter().copied().filter(|g| g.dtype == dtype).collect();
            let max = group.iter().map(|g| g.len as u64).max().unwrap_or(0);
            let Some(d) = launch::multi_tensor(group.len(), max)? else {
                continue;
            };
            let mut table: Vec<u8> = Vec::with_capacity(16 * group.len());
            for g in &group {
                table.extend_from_slice(&g.device_ptr().to_le_bytes());
            }
            for g in &group {
                table.extend_from_slice(&(g.len as u64).to_le_bytes());
            }
            // An F32-typed buffer of the right byte size carries the table.
            let t = self.upload_bytes(DType::F32, &table)?;
            let f = self.function(Kernel::Unscale, dtype)?;
            let (tp, n, ip, fp) = (
                t.device_ptr(),
                group.len() as u32,
                inv_scale.device_ptr(),
                found_inf.device_ptr(),
            );
            let mut b = self.stream.launch_builder(&f);
            b.arg(&tp).arg(&n).arg(&ip).arg(&fp);
            // SAFETY: the table lists live grads of this dtype and their lengths.
            unsafe { b.launch(to_cfg(d)) }.map_err(drv_err(op))?;
            // `t` returns to the stream's pool; stream order keeps it intact until the kernel ran.
        }
        Ok(())
    }

    /// `C[b] = A[b]·B[b]` by cuBLAS (`gemmStridedBatchedEx`, F32 compute). Views are in
    /// elements from each storage's start; C must already exist (`out_dtype` = its dtype).
    pub fn gemm(
        &self,
        a: (&CudaStorage, MatView),
        b: (&CudaStorage, MatView),
        c: (&CudaStorage, MatView),
        batch: usize,
    ) -> Result<GemmArgs> {
        let op = "cuda gemm";
        for s in [a.0, b.0, c.0] {
            self.check_mine(op, s)?;
        }
        if a.0.dtype != b.0.dtype {
            return Err(Error::dtype(
                op,
                b.0.dtype,
                format!("A is {:?}: operands must share a dtype", a.0.dtype),
            ));
        }
        let g = map_gemm(a.1, b.1, c.1, batch, a.0.dtype, c.0.dtype)?;
        for (name, (s, v)) in [("A", a), ("B", b), ("C", c)] {
            match v.extent(batch) {
                Some(e) if e <= s.len as u64 => {}
                e => {
                    return Err(Error::arg(
                        op,
                        format!(
                            "{name} view {v:?} x {batch} spans {e:?} elements, storage has {}",
                            s.len
                        ),
                    ))
                }
            }
        }
        let (x, y) = if g.swap_operands {
            (b.0, a.0)
        } else {
            (a.0, b.0)
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.bind(op)?;
        // SAFETY: the arguments describe matrices inside the three buffers (map_gemm checked
        // the layout; the caller's views must be in bounds), on the handle's stream.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                blas_op(g.transa),
                blas_op(g.transb),
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                x.device_ptr() as *const c_void,
                blas_type(g.a_type),
                g.lda,
                g.stride_a,
                y.device_ptr() as *const c_void,
                blas_type(g.b_type),
                g.ldb,
                g.stride_b,
                &beta as *const f32 as *const c_void,
                c.0.device_ptr() as *mut c_void,
                blas_type(g.c_type),
                g.ldc,
                g.stride_c,
                g.batch,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::device(op, format!("cuBLAS: {e:?} for {g:?}")))?;
        Ok(g)
    }
}
