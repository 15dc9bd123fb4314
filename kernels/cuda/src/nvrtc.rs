//! NVRTC, the CUDA C compiler library, opened by this crate itself: which one a server has
//! decides whether the kernels load at all, so the choice is made here, not by a fixed list of
//! library names.
//!
//! The PTX that NVRTC writes carries the ISA version of its CUDA release, and a driver loads
//! only PTX of its own CUDA version or older: NVRTC 13 output does not load on Debian 12's
//! driver 535 (CUDA 12.2). So of the NVRTC libraries a server has, [`Nvrtc::find`] takes the
//! newest whose CUDA version is at most the driver's: the NVRTC 11.8 the offline media carry
//! (Debian's `libnvrtc11.2`, `libnvrtc.so.11.2`) on a driver-535 box, a CUDA 12 or 13
//! toolkit's where the driver is newer. `ENGRAM_NVRTC` names one library file and overrides the
//! search (and the bound). [`Nvrtc::arch_for`] compiles for the device's own architecture, or, on a GPU newer
//! than the NVRTC knows, for the newest one it knows (PTX is forward compatible).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use crate::{CudaError, Result};

/// The library names searched, newest CUDA first: CUDA 13 and 12 toolkits' sonames, then CUDA
/// 11's (`libnvrtc.so.11.2` for every 11.x release, Debian's `libnvrtc11.2` included), then a
/// development symlink.
const NAMES: &[&str] = &[
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
    "libnvrtc.so",
];

type NvrtcResult = c_int;
type Program = *mut c_void;

/// The entry points used, resolved once at [`Nvrtc::open`].
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    num_archs: Option<unsafe extern "C" fn(*mut c_int) -> NvrtcResult>,
    archs: Option<unsafe extern "C" fn(*mut c_int) -> NvrtcResult>,
    error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    destroy: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
}

/// One opened NVRTC library.
pub struct Nvrtc {
    api: Api,
    /// The name or path it was opened by.
    name: String,
    /// (major, minor) CUDA version, e.g. (11, 8).
    version: (i32, i32),
    /// The virtual architectures it compiles for (80 for `compute_80`), ascending; empty when
    /// the library cannot list them (before CUDA 11.2).
    archs: Vec<i32>,
    // Kept open for as long as `api` points into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Nvrtc {
    /// Opens the NVRTC library `name` (a soname searched as the dynamic loader does, or a path).
    pub fn open(name: &str) -> Result<Nvrtc> {
        let unavailable = |why: String| CudaError::Unavailable(format!("{name}: {why}"));
        // SAFETY: loading NVRTC runs its initialisers, which only set up the library itself.
        let lib =
            unsafe { libloading::Library::new(name) }.map_err(|e| unavailable(e.to_string()))?;
        // SAFETY: each symbol is NVRTC's C entry point of that name with the signature its
        // header (nvrtc.h) gives, unchanged since CUDA 7 (the supported-architecture pair since
        // 11.2, looked up as optional).
        let api = {
            fn get<T: Copy>(
                lib: &libloading::Library,
                symbol: &str,
            ) -> std::result::Result<T, String> {
                // SAFETY: each symbol is NVRTC's C entry point of that name with the signature
                // its header (nvrtc.h) gives, unchanged since CUDA 7 (the supported-architecture
                // pair since 11.2, looked up as optional).
                unsafe { lib.get::<T>(symbol.as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| format!("no {symbol}: {e}"))
            }
            Api {
                version: get(&lib, "nvrtcVersion").map_err(unavailable)?,
                num_archs: get(&lib, "nvrtcGetNumSupportedArchs").ok(),
                archs: get(&lib, "nvrtcGetSupportedArchs").ok(),
                error_string: get(&lib, "nvrtcGetErrorString").map_err(unavailable)?,
                create: get(&lib, "nvrtcCreateProgram").map_err(unavailable)?,
                compile: get(&lib, "nvrtcCompileProgram").map_err(unavailable)?,
                ptx_size: get(&lib, "nvrtcGetPTXSize").map_err(unavailable)?,
                ptx: get(&lib, "nvrtcGetPTX").map_err(unavailable)?,
                log_size: get(&lib, "nvrtcGetProgramLogSize").map_err(unavailable)?,
                log: get(&lib, "nvrtcGetProgramLog").map_err(unavailable)?,
                destroy: get(&lib, "nvrtcDestroyProgram").map_err(unavailable)?,
            }
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters the call fills.
        let status = unsafe { (api.version)(&mut major, &mut minor) };
        if status != 0 {
            return Err(unavailable(format!("nvrtcVersion failed ({status})")));
        }
        let mut archs = Vec::new();
        if let (Some(count), Some(list)) = (api.num_archs, api.archs) {
            let mut n = 0;
            // SAFETY: `n` is filled first, then a buffer of exactly `n` entries.
            unsafe {
                if count(&mut n) == 0 && n > 0 {
                    archs = vec![0; n as usize];
                    if list(archs.as_mut_ptr()) != 0 {
                        archs.clear();
                    }
                }
            }
            archs.sort_unstable();
        }
        Ok(Nvrtc {
            api,
            name: name.to_string(),
            version: (major, minor),
            archs,
            _lib: lib,
        })
    }

    /// The NVRTC to compile with on this machine: `ENGRAM_NVRTC` when set (taken as it is), else
    /// the newest library found whose CUDA version is at most `driver` (the driver's
    /// `cuDriverGetVersion`, 12020 for CUDA 12.2; `None` with no driver: the newest found).
    /// Opened once per process and driver version.
    pub fn find(driver: Option<i32>) -> Result<Arc<Nvrtc>> {
        // The choice depends only on the machine (driver and libraries), so one per driver
        // version is kept.
        type Found = Vec<(Option<i32>, Arc<Nvrtc>)>;
        static FOUND: OnceLock<Mutex<Found>> = OnceLock::new();
        let found = FOUND.get_or_init(|| Mutex::new(Vec::new()));
        let mut found = found.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, n)) = found.iter().find(|(d, _)| *d == driver) {
            return Ok(n.clone());
        }
        let chosen = Arc::new(Self::search(driver)?);
        found.push((driver, chosen.clone()));
        Ok(chosen)
    }

    fn search(driver: Option<i32>) -> Result<Nvrtc> {
        if let Some(path) = std::env::var_os("ENGRAM_NVRTC") {
            // The operator's choice is taken as it is, even past the driver's version: the
            // driver's own error says so at the first kernel load if it matters.
            return Nvrtc::open(&path.to_string_lossy());
        }
        let mut too_new = Vec::new();
        let mut best: Option<Nvrtc> = None;
        for name in NAMES {
            let Ok(nvrtc) = Nvrtc::open(name) else {
                continue;
            };
            if let Some(why) = nvrtc.too_new_for(driver) {
                too_new.push(why);
                continue;
            }
            if best.as_ref().is_none_or(|b| nvrtc.version > b.version) {
                best = Some(nvrtc);
            }
        }
        best.ok_or_else(|| {
            let mut why = format!(
                "no NVRTC library ({}) {}",
                NAMES.join(", "),
                if too_new.is_empty() {
                    "found: install the media's libnvrtc11.2 or a CUDA toolkit's, or set ENGRAM_NVRTC"
                        .to_string()
                } else {
                    format!("the driver can load: {}", too_new.join("; "))
                }
            );
            if let Some(d) = driver {
                why.push_str(&format!(" (driver: CUDA {})", cuda_version(d)));
            }
            CudaError::Unavailable(why)
        })
    }

    /// Why this NVRTC's PTX would not load on a driver of CUDA version `driver`, if it would not.
    fn too_new_for(&self, driver: Option<i32>) -> Option<String> {
        let driver = driver?;
        let own = self.version.0 * 1000 + self.version.1 * 10;
        (own > driver).then(|| {
            format!(
                "{} is newer than the driver's CUDA {}",
                self.describe(),
                cuda_version(driver)
            )
        })
    }

    /// "NVRTC 11.8 (libnvrtc.so.11.2)".
    pub fn describe(&self) -> String {
        let file = Path::new(&self.name)
            .file_name()
            .map_or(self.name.clone(), |f| f.to_string_lossy().into_owned());
        format!("NVRTC {}.{} ({file})", self.version.0, self.version.1)
    }

    /// (major, minor) CUDA version of this NVRTC.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The virtual architecture to compile for a device of compute capability `major.minor`:
    /// its own when this NVRTC knows it, else the newest this NVRTC knows below it (the driver
    /// JIT-compiles that PTX for the newer GPU), e.g. `compute_90` for a Blackwell GPU under
    /// NVRTC 11.8.
    pub fn arch_for(&self, major: i32, minor: i32) -> Result<String> {
        let own = major * 10 + minor;
        if self.archs.is_empty() || self.archs.contains(&own) {
            return Ok(format!("compute_{own}"));
        }
        self.archs
            .iter()
            .rev()
            .find(|&&a| a < own)
            .map(|a| format!("compute_{a}"))
            .ok_or_else(|| {
                CudaError::Unsupported(format!(
                    "{} compiles for none of compute_{own} or older",
                    self.describe()
                ))
            })
    }

    /// Compiles `source` (named `name` in messages) to PTX with `options`; a failed compile's
    /// error holds NVRTC's log.
    pub fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<String> {
        let compile_error =
            |what: String| CudaError::Compile(format!("{}: {what}", self.describe()));
        let source = CString::new(source).map_err(|e| compile_error(e.to_string()))?;
        let name = CString::new(name).map_err(|e| compile_error(e.to_string()))?;
        let options = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| compile_error(e.to_string()))?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings that outlive the calls; the program is destroyed on
        // every path below (ProgramGuard).
        unsafe {
            self.check(
                (self.api.create)(
                    &mut program,
                    source.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                ),
                "nvrtcCreateProgram",
            )?;
            let _guard = ProgramGuard(self, program);
            let status =
                (self.api.compile)(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            if status != 0 {
                let log = self
                    .read(program, self.api.log_size, self.api.log)
                    .unwrap_or_default();
                return Err(compile_error(format!(
                    "{} with {:?}:\n{log}",
                    self.error_string(status),
                    options
                )));
            }
            self.read(program, self.api.ptx_size, self.api.ptx)
        }
    }

    /// Reads one of the program's strings (the PTX or the log) through its size and copy calls.
    ///
    /// # Safety
    /// `program` is a live program of this library.
    unsafe fn read(
        &self,
        program: Program,
        size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
        copy: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    ) -> Result<String> {
        let mut n = 0usize;
        // SAFETY: the caller's program; `n` bytes are allocated before the copy writes them.
        unsafe {
            self.check(size(program, &mut n), "nvrtcGet*Size")?;
            let mut buf = vec![0u8; n.max(1)];
            self.check(copy(program, buf.as_mut_ptr().cast()), "nvrtcGet*")?;
            let text = CStr::from_bytes_until_nul(&buf)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Ok(text)
        }
    }

    fn check(&self, status: NvrtcResult, call: &str) -> Result<()> {
        if status == 0 {
            Ok(())
        } else {
            Err(CudaError::Compile(format!(
                "{}: {call}: {}",
                self.describe(),
                self.error_string(status)
            )))
        }
    }

    fn error_string(&self, status: NvrtcResult) -> String {
        // SAFETY: NVRTC returns a static string for any status value.
        let text = unsafe { (self.api.error_string)(status) };
        if text.is_null() {
            return format!("NVRTC error {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Destroys an NVRTC program when dropped.
struct ProgramGuard<'a>(&'a Nvrtc, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        let mut program = self.1;
        // SAFETY: a program this library created, destroyed once.
        unsafe {
            (self.0.api.destroy)(&mut program);
        }
    }
}

/// "12.2" for the driver API's 12020.
pub fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_versions_read_as_major_minor() {
        assert_eq!(cuda_version(12020), "12.2");
        assert_eq!(cuda_version(11080), "11.8");
        assert_eq!(cuda_version(13000), "13.0");
    }

    #[test]
    fn a_missing_library_is_unavailable_not_a_panic() {
        let err = Nvrtc::open("/nonexistent/libnvrtc.so.99").unwrap_err();
        assert!(matches!(err, CudaError::Unavailable(_)), "{err}");
    }
}
