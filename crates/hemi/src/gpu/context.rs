//! One wgpu context per ordinal (`gpu:n`): instance, adapter, device and queue, created on
//! first use and shared by every buffer on that device; its caching allocator and its
//! pipeline cache. Every failure is an `Error::Device` naming the device and the fix.

use std::cell::Cell;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, OnceLock};

use crate::device::Device;
use crate::device_alloc::{BlockHandle, CachingAllocator, MemoryStats, RawAllocator};
use crate::error::{Error, Result};

/// Segment addresses carry the segment's number above this bit, the offset below.
const SEGMENT_SHIFT: u32 = 40;
/// The allocator's one stream: wgpu has one queue per device, which orders every use.
const STREAM: u64 = 0;
/// Threads per workgroup of the one-dimensional kernels.
pub const WORKGROUP: u32 = 64;
/// The most workgroups along one dispatch dimension (WebGPU's minimum limit).
pub const MAX_GROUPS: u32 = 65_535;
/// Bytes of a kernel's parameter buffer (1024 words: layouts up to rank 300 or so).
const PARAM_BYTES: u64 = 4096;

thread_local! {
    /// Set inside [`with_packed_halves`]: this thread's kernels use the packed route.
    static PACKED_HALVES: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's F16 kernels on the packed-`u32` route (two halves a word,
/// converted in integer arithmetic), as on an adapter without `SHADER_F16`, and returns its
/// result. Both routes store the same bytes and round the same way, so buffers pass freely
/// between them; this exists to test the fallback on adapters that have `SHADER_F16`, and to
/// sidestep a driver whose native half support misbehaves.
pub fn with_packed_halves<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            PACKED_HALVES.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(PACKED_HALVES.with(|c| c.replace(true)));
    f()
}

/// What a context knows of its adapter.
#[derive(Clone, Debug)]
pub struct AdapterInfo {
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)` for lavapipe).
    pub name: String,
    /// The driver's name and version.
    pub driver: String,
    /// True where the adapter supports WGSL `enable f16;` (wgpu's `SHADER_F16`).
    pub shader_f16: bool,
    /// The largest storage buffer a shader may bind, in bytes.
    pub max_binding: u64,
}

/// wgpu buffers as the caching allocator's raw allocations: one buffer per segment, its
/// address `number << 40`.
struct Segments {
    device: wgpu::Device,
    device_name: Device,
    max_buffer: u64,
    buffers: HashMap<u64, wgpu::Buffer>,
    next: u64,
}

impl RawAllocator for Segments {
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64> {
        let oom = |why: String| {
            Error::device(
                "gpu malloc",
                format!(
                    "out of memory on {}: cannot allocate {bytes} bytes ({why}); use smaller \
                     batches or --device cpu",
                    self.device_name
                ),
            )
        };
        if bytes as u64 > self.max_buffer {
            return Err(oom(format!(
                "the adapter's largest buffer is {} bytes",
                self.max_buffer
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hemi segment"),
            size: bytes as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            buffer.destroy();
            return Err(oom(e.to_string()));
        }
        self.next += 1;
        let ptr = self.next << SEGMENT_SHIFT;
        self.buffers.insert(ptr, buffer);
        Ok(ptr)
    }

    fn raw_free(&mut self, ptr: u64) -> Result<()> {
        if let Some(b) = self.buffers.remove(&ptr) {
            b.destroy();
        }
        Ok(())
    }
}

/// A device of the wgpu backend: its queue, allocator and compiled pipelines.
pub struct GpuContext {
    ordinal: usize,
    info: AdapterInfo,
    device: wgpu::Device,
    queue: wgpu::Queue,
    alloc: Mutex<CachingAllocator<Segments>>,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// Free parameter buffers. Parameters are not allocator blocks: wgpu tracks a buffer's
    /// usage as a whole, so a read-only binding beside a writable one of the same segment
    /// is a validation error (the blocks bind read_write, the parameters read-only, which
    /// keeps them uniform for the kernels' loops and barriers).
    params: Mutex<Vec<wgpu::Buffer>>,
    /// An error wgpu reported outside an error scope (validation, out of memory), taken by
    /// the next check; or the reason the device was lost (kept).
    errors: Arc<Mutex<Option<String>>>,
    lost: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuContext(gpu:{}, {})", self.ordinal, self.info.name)
    }
}

/// A live block of device memory: freed back to its context's cache when dropped.
pub struct Block {
    ctx: Arc<GpuContext>,
    handle: BlockHandle,
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Ok(mut a) = self.ctx.alloc.lock() {
            // A block the allocator does not know is a bug elsewhere; freeing never panics.
            let _ = a.free(self.handle);
        }
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Block({} bytes on gpu:{})",
            self.handle.size, self.ctx.ordinal
        )
    }
}

impl Block {
    /// The context that owns the block.
    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.ctx
    }
    /// Usable bytes (the request rounded up to 512).
    pub fn size(&self) -> u64 {
        self.handle.size as u64
    }
    fn offset(&self) -> u64 {
        self.handle.ptr & ((1 << SEGMENT_SHIFT) - 1)
    }
    fn buffer(&self) -> Result<wgpu::Buffer> {
        let a = self.ctx.alloc.lock().map_err(|_| self.ctx.poisoned())?;
        let seg = self.handle.ptr & !((1 << SEGMENT_SHIFT) - 1);
        a.raw().buffers.get(&seg).cloned().ok_or_else(|| {
            Error::device(
                "gpu",
                format!(
                    "a block on {} outlived its segment (a bug in hemi's allocator: report \
                         it, or use --device cpu)",
                    self.ctx.device()
                ),
            )
        })
    }
}

type Contexts = Mutex<HashMap<usize, Arc<GpuContext>>>;

fn contexts() -> &'static Contexts {
    static C: OnceLock<Contexts> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The fix printed with every missing-adapter error.
const NO_ADAPTER_FIX: &str = "install a Vulkan driver (Debian: mesa-vulkan-drivers, which \
                              includes the lavapipe software device) or use --device cpu";

/// The Vulkan adapters wgpu finds, in its order (`gpu:n` is the `n`-th).
fn adapters() -> Vec<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN))
}

/// The number of GPUs the wgpu backend can use (0 without a Vulkan driver).
pub fn device_count() -> usize {
    adapters().len()
}

/// The context of `gpu:ordinal`, created on first use.
pub fn context(ordinal: usize) -> Result<Arc<GpuContext>> {
    let mut map = contexts()
        .lock()
        .map_err(|_| Error::device("gpu", "the context table was poisoned".to_string()))?;
    if let Some(c) = map.get(&ordinal) {
        return Ok(c.clone());
    }
    let ctx = GpuContext::open(ordinal)?;
    map.insert(ordinal, ctx.clone());
    Ok(ctx)
}

impl GpuContext {
    /// A new context of its own on `gpu:ordinal` (a second wgpu device on the adapter),
    /// shared with nobody: [`context`] keeps the one every tensor uses. Buffers of two
    /// contexts never meet in one kernel (mixing them is the device error). For tools and
    /// tests that must not disturb the shared device ([`GpuContext::destroy`]).
    pub fn open(ordinal: usize) -> Result<Arc<GpuContext>> {
        open(ordinal)
    }
}

fn open(ordinal: usize) -> Result<Arc<GpuContext>> {
    let dev = Device::Gpu(ordinal);
    let mut all = adapters();
    if all.is_empty() {
        return Err(Error::device(
            "gpu",
            format!("no GPU adapter found for {dev}: {NO_ADAPTER_FIX}"),
        ));
    }
    if ordinal >= all.len() {
        return Err(Error::device(
            "gpu",
            format!(
                "{dev} does not exist: {} Vulkan adapter(s) found (gpu:0..gpu:{})",
                all.len(),
                all.len() - 1
            ),
        ));
    }
    let adapter = all.swap_remove(ordinal);
    let ai = adapter.get_info();
    let features = adapter.features() & wgpu::Features::SHADER_F16;
    let limits = adapter.limits();
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("hemi"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    }))
    .map_err(|e| {
        Error::device(
            "gpu",
            format!("cannot open {dev} ({}): {e}; {NO_ADAPTER_FIX}", ai.name),
        )
    })?;
    let errors = Arc::new(Mutex::new(None::<String>));
    let sink = errors.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        if let Ok(mut slot) = sink.lock() {
            slot.get_or_insert_with(|| e.to_string());
        }
    }));
    let lost = Arc::new(Mutex::new(None::<String>));
    let sink = lost.clone();
    device.set_device_lost_callback(move |reason, msg| {
        if let Ok(mut slot) = sink.lock() {
            *slot = Some(format!("{reason:?}: {msg}"));
        }
    });
    let info = AdapterInfo {
        name: ai.name.clone(),
        driver: format!("{} {}", ai.driver, ai.driver_info),
        shader_f16: features.contains(wgpu::Features::SHADER_F16),
        max_binding: limits.max_storage_buffer_binding_size,
    };
    let segments = Segments {
        device: device.clone(),
        device_name: dev,
        max_buffer: limits
            .max_buffer_size
            .min(limits.max_storage_buffer_binding_size),
        buffers: HashMap::new(),
        next: 0,
    };
    let ctx = Arc::new(GpuContext {
        ordinal,
        info,
        device,
        queue,
        alloc: Mutex::new(CachingAllocator::new(segments)),
        pipelines: Mutex::new(HashMap::new()),
        params: Mutex::new(Vec::new()),
        errors,
        lost,
    });
    Ok(ctx)
}

impl GpuContext {
    /// `gpu:n`.
    pub fn device(&self) -> Device {
        Device::Gpu(self.ordinal)
    }

    /// The adapter's name, driver and capabilities.
    pub fn info(&self) -> &AdapterInfo {
        &self.info
    }

    /// True where this thread's kernels read and write F16 buffers as WGSL `array<f16>`
    /// (the adapter has `SHADER_F16`, requested at device creation, and the caller is not
    /// inside [`with_packed_halves`]); false on the packed-`u32` route.
    pub fn native_f16(&self) -> bool {
        self.info.shader_f16 && !PACKED_HALVES.with(|c| c.get())
    }

    /// The allocator's counters.
    pub fn memory_stats(&self) -> MemoryStats {
        self.alloc.lock().map(|a| a.stats()).unwrap_or_default()
    }

    /// Destroys the device now: its memory is freed, and every later use of this context
    /// or its buffers is the lost-device `Error`, as after a driver reset.
    pub fn destroy(&self) {
        if let Ok(mut slot) = self.lost.lock() {
            slot.get_or_insert_with(|| "destroyed by GpuContext::destroy".to_string());
        }
        self.device.destroy();
    }

    /// A failed read-back: names the device, the reason and the fix.
    fn readback_failed(&self, why: impl std::fmt::Display) -> Error {
        Error::device(
            "download",
            format!(
                "reading a buffer back from {} ({}) failed: {why}; the device may have been \
                 lost or be out of memory: restart the process, use smaller batches, or use \
                 --device cpu",
                self.device(),
                self.info.name
            ),
        )
    }

    fn poisoned(&self) -> Error {
        Error::device(
            "gpu",
            format!(
                "{}: a thread panicked while holding its state",
                self.device()
            ),
        )
    }

    /// Errors if the device was lost or wgpu reported an error since the last check.
    pub fn check(&self, op: &'static str) -> Result<()> {
        if let Some(why) = self.lost.lock().map_err(|_| self.poisoned())?.as_ref() {
            return Err(Error::device(
                op,
                format!(
                    "{} was lost ({why}); its tensors are gone: restart the process, or use \
                     --device cpu",
                    self.device()
                ),
            ));
        }
        if let Some(why) = self.errors.lock().map_err(|_| self.poisoned())?.take() {
            return Err(Error::device(
                op,
                format!("{} reported an error: {why}", self.device()),
            ));
        }
        Ok(())
    }

    /// A block of at least `bytes` bytes (at least 4) from the cache.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Block> {
        let handle = self
            .alloc
            .lock()
            .map_err(|_| self.poisoned())?
            .malloc(bytes.max(4), STREAM)?;
        Ok(Block {
            ctx: self.clone(),
            handle,
        })
    }

    /// A block holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload_bytes(self: &Arc<Self>, data: &[u8]) -> Result<Block> {
        self.check("upload")?;
        let block = self.alloc(data.len())?;
        let buffer = block.buffer()?;
        let mut padded = data.len().next_multiple_of(4);
        if padded == 0 {
            padded = 4;
        }
        if padded == data.len() {
            self.queue.write_buffer(&buffer, block.offset(), data);
        } else {
            let mut v = data.to_vec();
            v.resize(padded, 0);
            self.queue.write_buffer(&buffer, block.offset(), &v);
        }
        Ok(block)
    }

    /// The first `bytes` bytes of `block`, read back to the host (waits for the queue).
    pub fn download_bytes(&self, block: &Block, bytes: usize) -> Result<Vec<u8>> {
        self.check("download")?;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let size = bytes.next_multiple_of(4) as u64;
        if size > block.size() {
            return Err(self.readback_failed(format!(
                "{bytes} bytes asked of a {} byte buffer",
                block.size()
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hemi download"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            staging.destroy();
            return Err(self.readback_failed(format!("no host-visible staging buffer: {e}")));
        }
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        enc.copy_buffer_to_buffer(&block.buffer()?, block.offset(), &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..)
            .map_async(wgpu::MapMode::Read, move |r| drop(tx.send(r)));
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| self.readback_failed(e))?;
        let mapped = rx
            .recv()
            .map_err(|_| self.readback_failed("the read-back never completed"))?;
        mapped.map_err(|e| self.readback_failed(e))?;
        let out = {
            let view = staging
                .slice(..)
                .get_mapped_range()
                .map_err(|e| self.readback_failed(e))?;
            view[..bytes].to_vec()
        };
        staging.unmap();
        staging.destroy();
        self.check("download")?;
        Ok(out)
    }

    /// The pipeline compiled from `source` (cached by its text), entry point `main`.
    fn pipeline(&self, source: &str) -> Result<Arc<wgpu::ComputePipeline>> {
        if let Some(p) = self
            .pipelines
            .lock()
            .map_err(|_| self.poisoned())?
            .get(source)
        {
            return Ok(p.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("hemi kernel"),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some("hemi kernel"),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::device(
                "gpu shader",
                format!(
                    "{}: a WGSL kernel failed to compile ({e}); this is a bug in hemi's \
                     shaders or the driver: report it with the adapter ({}, {}), or use \
                     --device cpu",
                    self.device(),
                    self.info.name,
                    self.info.driver
                ),
            ));
        }
        let p = Arc::new(pipeline);
        self.pipelines
            .lock()
            .map_err(|_| self.poisoned())?
            .insert(source.to_string(), p.clone());
        Ok(p)
    }

    /// Runs the kernel `source` over `groups` workgroups with its bindings in order:
    /// `params` (the `u32` words at binding 0), `out` (binding 1), then `inputs` (2, 3, ..).
    pub fn launch(
        self: &Arc<Self>,
        op: &'static str,
        source: &str,
        params: &[u32],
        out: &Block,
        inputs: &[&Block],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        self.check(op)?;
        if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
            return Ok(());
        }
        if groups.0 > MAX_GROUPS || groups.1 > MAX_GROUPS || groups.2 > MAX_GROUPS {
            return Err(Error::arg(
                op,
                format!(
                    "{} workgroups exceed {}'s limit of {MAX_GROUPS} per dimension",
                    groups.0.max(groups.1).max(groups.2),
                    self.device()
                ),
            ));
        }
        let pipeline = self.pipeline(source)?;
        let bytes: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        if bytes.len() as u64 > PARAM_BYTES {
            return Err(Error::arg(
                op,
                format!(
                    "{} parameter words exceed the GPU backend's {} (a layout of very high rank)",
                    params.len(),
                    PARAM_BYTES / 4
                ),
            ));
        }
        let pbuf = self.params.lock().map_err(|_| self.poisoned())?.pop();
        let pbuf = pbuf.unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("hemi params"),
                size: PARAM_BYTES,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        if !bytes.is_empty() {
            self.queue.write_buffer(&pbuf, 0, &bytes);
        }
        let blocks: Vec<&Block> = [out].into_iter().chain(inputs.iter().copied()).collect();
        let buffers = blocks
            .iter()
            .map(|b| b.buffer())
            .collect::<Result<Vec<_>>>()?;
        for b in &blocks {
            if b.size() > self.info.max_binding {
                return Err(Error::device(
                    op,
                    format!(
                        "out of memory on {}: a {} byte buffer exceeds the adapter's largest \
                         binding ({} bytes); use smaller batches or --device cpu",
                        self.device(),
                        b.size(),
                        self.info.max_binding
                    ),
                ));
            }
        }
        let mut entries: Vec<wgpu::BindGroupEntry<'_>> = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: pbuf.as_entire_binding(),
        }];
        entries.extend(
            blocks
                .iter()
                .zip(&buffers)
                .enumerate()
                .map(|(i, (b, buf))| wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: buf,
                        offset: b.offset(),
                        size: NonZeroU64::new(b.size()),
                    }),
                }),
        );
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        }
        self.queue.submit([enc.finish()]);
        // The parameter buffer goes back to the free list; the queue orders its next write
        // after this kernel.
        drop((entries, bind));
        self.params.lock().map_err(|_| self.poisoned())?.push(pbuf);
        self.check(op)
    }
}

/// Workgroups for `threads` invocations of a one-dimensional kernel: `(x, y, 1)` with
/// `x * y * WORKGROUP >= threads` (a kernel's thread index is `gid.x + gid.y * x * 64`).
pub fn groups_1d(threads: usize) -> (u32, u32, u32) {
    let g = threads.div_ceil(WORKGROUP as usize);
    if g == 0 {
        return (0, 1, 1);
    }
    let x = g.min(MAX_GROUPS as usize);
    (x as u32, g.div_ceil(x) as u32, 1)
}

/// Workgroups for one workgroup per item (`items` of them): `(x, y, 1)`, item
/// `wid.x + wid.y * x`.
pub fn groups_per_item(items: usize) -> (u32, u32, u32) {
    if items == 0 {
        return (0, 1, 1);
    }
    let x = items.min(MAX_GROUPS as usize);
    (x as u32, items.div_ceil(x) as u32, 1)
}
