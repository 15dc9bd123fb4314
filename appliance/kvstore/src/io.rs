//! Reading blob files: io_uring batches, plain `pread`, O_DIRECT-aligned buffers. The crate's
//! only `unsafe`.
//!
//! Why unsafe is needed here and nowhere else:
//!
//! - io_uring hands the kernel raw buffer pointers that it writes to *after* `push` returns, so
//!   the borrow checker cannot see the write. The invariant this module keeps: a request's
//!   buffer and file stay alive and untouched from the `push` of its read until its completion
//!   is reaped; if the ring fails with requests still in flight, their buffers are leaked rather
//!   than freed (see [`Ring::read_batch`]).
//! - O_DIRECT needs buffers aligned to [`DIRECT_ALIGN`], which only `std::alloc` with an explicit
//!   `Layout` gives ([`ReadBuf`] owns one and frees it on drop).
//! - The kernel fills buffers that were never initialized; a buffer only ever exposes the prefix
//!   the kernel reported as written, so no uninitialized byte is read. Buffered reads go straight
//!   into the `Arc<[u8]>` that is returned (no copy); O_DIRECT reads are copied out of the
//!   aligned buffer once, truncated to the file length.
//! - `pread` and `posix_fadvise` (for [`drop_cached_pages`]) are raw libc calls.

#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

/// Alignment (and length granularity) of O_DIRECT buffers and offsets: the page size, which
/// covers both 512-byte and 4 KiB logical blocks.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Largest single read request; bigger blobs are read in several (a read's length is a `u32` in
/// io_uring, and Linux caps one read at just under 2 GiB anyway).
const MAX_READ: usize = 1 << 30;

/// Memory a read lands in: aligned for O_DIRECT, or the returned `Arc` itself for buffered reads.
pub(crate) enum ReadBuf {
    Aligned(AlignedBuf),
    Shared(Arc<[MaybeUninit<u8>]>),
}

impl ReadBuf {
    /// A buffer for a file of `len` bytes (aligned ones are rounded up to [`DIRECT_ALIGN`]).
    pub fn new(len: usize, aligned: bool) -> ReadBuf {
        if aligned {
            ReadBuf::Aligned(AlignedBuf::new(len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN))
        } else {
            ReadBuf::Shared(Arc::new_uninit_slice(len))
        }
    }

    pub fn capacity(&self) -> usize {
        match self {
            ReadBuf::Aligned(b) => b.cap,
            ReadBuf::Shared(a) => a.len(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            ReadBuf::Aligned(b) => b.ptr.as_ptr(),
            ReadBuf::Shared(a) => Arc::get_mut(a)
                .expect("a read buffer has a single owner until it is returned")
                .as_mut_ptr()
                .cast(),
        }
    }

    /// The first `filled` bytes, which the kernel wrote, as an `Arc<[u8]>`.
    fn into_arc(self, filled: usize) -> Arc<[u8]> {
        assert!(filled <= self.capacity());
        match self {
            ReadBuf::Shared(a) if filled == a.len() => {
                // SAFETY: `filled` bytes were reported written by the kernel and that is every
                // byte of the slice, so all of it is initialized.
                unsafe { a.assume_init() }
            }
            ReadBuf::Shared(a) => {
                // SAFETY: the first `filled` bytes were written by the kernel (initialized), and
                // `filled <= a.len()` was asserted above.
                let init = unsafe { std::slice::from_raw_parts(a.as_ptr().cast::<u8>(), filled) };
                Arc::from(init)
            }
            ReadBuf::Aligned(b) => {
                // SAFETY: as above: the prefix of `filled <= cap` bytes was written by the kernel.
                let init = unsafe { std::slice::from_raw_parts(b.ptr.as_ptr(), filled) };
                Arc::from(init)
            }
        }
    }
}

/// A heap buffer aligned to [`DIRECT_ALIGN`], uninitialized, freed on drop.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
}

impl AlignedBuf {
    fn new(cap: usize) -> AlignedBuf {
        if cap == 0 {
            return AlignedBuf {
                ptr: NonNull::dangling(),
                cap,
            };
        }
        let layout = Self::layout(cap);
        // SAFETY: `layout` has a non-zero size (checked above) and a valid power-of-two alignment.
        let ptr = unsafe { alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap }
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, DIRECT_ALIGN).expect("read buffer size overflows isize")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: `ptr` came from `alloc::alloc` with exactly this layout and is freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
        }
    }
}

// SAFETY: `AlignedBuf` uniquely owns its allocation (like a `Box<[u8]>`); nothing else aliases it.
unsafe impl Send for AlignedBuf {}

/// One whole-file read: the open file, its length at open, and where the bytes go.
pub(crate) struct ReadReq {
    /// `None` only after [`leak_in_flight`].
    file: Option<File>,
    len: usize,
    direct: bool,
    buf: ReadBuf,
    filled: usize,
    error: Option<io::Error>,
    done: bool,
    finished: Option<Instant>,
}

impl ReadReq {
    /// `direct`: the file was opened with O_DIRECT, so every read is aligned.
    pub fn new(file: File, len: usize, direct: bool) -> ReadReq {
        ReadReq {
            file: Some(file),
            len,
            direct,
            buf: ReadBuf::new(len, direct),
            filled: 0,
            error: None,
            done: len == 0,
            finished: None,
        }
    }

    /// Whether the read failed with EINVAL under O_DIRECT (the file system refuses direct I/O
    /// for this file): the caller retries it buffered.
    pub fn direct_refused(&self) -> bool {
        self.direct
            && self
                .error
                .as_ref()
                .is_some_and(|e| e.raw_os_error() == Some(libc::EINVAL))
    }

    /// Failure injection: turns a finished O_DIRECT read into the file system's refusal.
    #[cfg(test)]
    pub fn refuse_if_direct(&mut self) {
        if self.direct {
            self.error = Some(io::Error::from_raw_os_error(libc::EINVAL));
        }
    }

    /// The bytes read (truncated to what the file held), and when the last of them arrived.
    pub fn finish(self) -> io::Result<(Arc<[u8]>, Instant)> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let finished = self.finished.unwrap_or_else(Instant::now);
        let n = self.filled.min(self.len);
        Ok((self.buf.into_arc(n), finished))
    }

    /// Offset and length of the next read.
    fn next(&self) -> (usize, usize) {
        let end = if self.direct {
            self.buf.capacity()
        } else {
            self.len
        };
        (self.filled, (end - self.filled).min(MAX_READ))
    }

    /// Accounts one read's result (bytes, or a negated errno).
    fn complete(&mut self, res: isize) {
        if res < 0 {
            let errno = (-res) as i32;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                return;
            }
            self.error = Some(io::Error::from_raw_os_error(errno));
            self.finish_now();
            return;
        }
        let n = res as usize;
        self.filled += n;
        // End of file: nothing more, the file length reached, or a direct read that stopped
        // short of a block boundary.
        if n == 0
            || self.filled >= self.len
            || (self.direct && !self.filled.is_multiple_of(DIRECT_ALIGN))
        {
            self.finish_now();
        }
    }

    fn raw_fd(&self) -> i32 {
        self.file.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    fn finish_now(&mut self) {
        self.done = true;
        self.finished = Some(Instant::now());
    }
}

/// Reads every request to completion with `pread`, one after another.
pub(crate) fn read_plain(reqs: &mut [ReadReq]) {
    for r in reqs.iter_mut() {
        while !r.done {
            let (off, len) = r.next();
            let fd = r.raw_fd();
            let ptr = r.buf.as_mut_ptr();
            // SAFETY: `ptr + off .. ptr + off + len` lies inside the request's buffer
            // (`next` keeps `off + len <= capacity`), which is alive and not otherwise borrowed
            // for the duration of this synchronous call; `fd` is an open file owned by `r`.
            let res = unsafe { libc::pread(fd, ptr.add(off).cast(), len, off as libc::off_t) };
            let res = if res < 0 {
                -(io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO) as isize)
            } else {
                res
            };
            r.complete(res);
        }
    }
}

/// Submission queue entries per ring: reads in flight at once. A `get_many` of a prompt's
/// chunks is ten or twenty blobs; larger batches are refilled as reads complete.
pub(crate) const RING_ENTRIES: u32 = 64;

/// One io_uring instance.
pub(crate) struct Ring(IoUring);

impl Ring {
    pub fn new() -> io::Result<Ring> {
        IoUring::new(RING_ENTRIES).map(Ring)
    }

    /// Reads every request to completion, keeping up to [`RING_ENTRIES`] reads in flight.
    ///
    /// An `Err` means the ring itself failed (not a read): requests still in flight have had
    /// their buffers and files leaked, so the kernel can never write into freed memory; they
    /// report the error. The ring must not be used again.
    pub fn read_batch(&mut self, reqs: &mut [ReadReq]) -> io::Result<()> {
        let capacity = self.0.params().sq_entries() as usize;
        let mut queued: std::collections::VecDeque<usize> =
            (0..reqs.len()).filter(|&i| !reqs[i].done).collect();
        let mut in_flight = vec![false; reqs.len()];
        let mut n_in_flight = 0;
        loop {
            {
                let mut sq = self.0.submission();
                while n_in_flight < capacity {
                    let Some(i) = queued.pop_front() else { break };
                    let r = &mut reqs[i];
                    let (off, len) = r.next();
                    let ptr = r.buf.as_mut_ptr();
                    let entry = opcode::Read::new(
                        types::Fd(r.raw_fd()),
                        // SAFETY: `off + len <= capacity` of the buffer (see `ReadReq::next`).
                        unsafe { ptr.add(off) },
                        len as u32,
                    )
                    .offset(off as u64)
                    .build()
                    .user_data(i as u64);
                    // SAFETY: the buffer range and the file stay alive and unused by anyone else
                    // until this entry's completion is reaped below: `reqs` is borrowed mutably
                    // for the whole call, and on a ring failure in-flight requests are leaked.
                    // The queue has room: at most `capacity` entries are ever in flight.
                    unsafe { sq.push(&entry) }.expect("submission queue has room");
                    in_flight[i] = true;
                    n_in_flight += 1;
                }
            }
            if n_in_flight == 0 {
                return Ok(());
            }
            match self.0.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    for (i, r) in reqs.iter_mut().enumerate() {
                        if in_flight[i] {
                            leak_in_flight(r, &e);
                        } else if !r.done {
                            r.error = Some(io::Error::new(e.kind(), e.to_string()));
                            r.finish_now();
                        }
                    }
                    return Err(e);
                }
            }
            for cqe in self.0.completion() {
                let i = cqe.user_data() as usize;
                in_flight[i] = false;
                n_in_flight -= 1;
                reqs[i].complete(cqe.result() as isize);
                if !reqs[i].done {
                    queued.push_back(i);
                }
            }
        }
    }
}

/// Gives up on a request the kernel may still write to: its buffer and file are forgotten, never
/// freed or closed, so the late write lands in memory nobody else will ever own.
fn leak_in_flight(r: &mut ReadReq, e: &io::Error) {
    let buf = std::mem::replace(&mut r.buf, ReadBuf::Shared(Arc::new_uninit_slice(0)));
    std::mem::forget(buf);
    if let Some(file) = r.file.take() {
        std::mem::forget(file);
    }
    r.filled = 0;
    r.error = Some(io::Error::new(e.kind(), e.to_string()));
    r.finish_now();
}

/// Whether io_uring works here: a ring can be set up, supports `Read`, and completes a no-op.
/// Sandboxes refuse it in different ways (ENOSYS, EPERM from seccomp or
/// `kernel.io_uring_disabled`); each comes back as the error.
pub(crate) fn probe_uring() -> io::Result<()> {
    let mut ring = IoUring::new(2)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    if !probe.is_supported(opcode::Read::CODE) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "io_uring does not support the Read opcode (kernel older than 5.6)",
        ));
    }
    let nop = opcode::Nop::new().build().user_data(42);
    // SAFETY: a no-op references no memory or file.
    unsafe { ring.submission().push(&nop) }.expect("empty queue has room");
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("io_uring no-op did not complete"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    Ok(())
}

/// Asks the kernel to drop the page-cache pages of the file at `path` (`posix_fadvise`
/// `POSIX_FADV_DONTNEED`), so the next buffered read comes from the device. Only clean pages
/// are dropped; stored blobs are fsynced, so all of theirs are. Benchmarks use it to measure
/// cold reads without root (`/proc/sys/vm/drop_caches`).
pub fn drop_cached_pages(path: &std::path::Path) -> io::Result<()> {
    let file = File::open(path)?;
    // SAFETY: `posix_fadvise` only reads its integer arguments; `file` keeps the descriptor
    // open for the call.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        // posix_fadvise returns the error number instead of setting errno.
        Err(io::Error::from_raw_os_error(rc))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn file_with(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    #[test]
    fn aligned_buffers_are_aligned_and_rounded() {
        for len in [0, 1, 4095, 4096, 4097, 10_000] {
            let mut b = ReadBuf::new(len, true);
            assert_eq!(b.capacity() % DIRECT_ALIGN, 0);
            assert!(b.capacity() >= len);
            if b.capacity() > 0 {
                assert_eq!(b.as_mut_ptr() as usize % DIRECT_ALIGN, 0);
            }
        }
    }

    #[test]
    fn plain_and_uring_reads_return_whole_files() {
        let dir = tempfile::tempdir().unwrap();
        let sizes = [0usize, 1, 4095, 4096, 4097, 100_000];
        let paths: Vec<_> = sizes
            .iter()
            .map(|&n| {
                let bytes: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
                (file_with(dir.path(), &format!("f{n}"), &bytes), bytes)
            })
            .collect();
        let reqs = |direct: bool| -> Vec<ReadReq> {
            paths
                .iter()
                .map(|(p, b)| ReadReq::new(File::open(p).unwrap(), b.len(), direct))
                .collect()
        };
        let check = |reqs: Vec<ReadReq>| {
            for (r, (_, b)) in reqs.into_iter().zip(&paths) {
                assert_eq!(&r.finish().unwrap().0[..], &b[..]);
            }
        };
        let mut plain = reqs(false);
        read_plain(&mut plain);
        check(plain);
        match probe_uring() {
            Ok(()) => {
                let mut ring = Ring::new().unwrap();
                let mut batch = reqs(false);
                ring.read_batch(&mut batch).unwrap();
                check(batch);
            }
            Err(e) => eprintln!("io_uring unavailable here ({e}); uring read not exercised"),
        }
    }

    #[test]
    fn dropping_cached_pages_of_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = file_with(dir.path(), "f", &[1; 10_000]);
        drop_cached_pages(&p).unwrap();
        assert!(drop_cached_pages(&dir.path().join("missing")).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), vec![1; 10_000]);
    }
}
