//! A persistent worker pool with a scoped parallel-for, so kernels never spawn threads per call.
//!
//! [`ThreadPool::run`] hands `n_tasks` task indices to the pool's workers and to the calling
//! thread, which participates as one worker, and returns once every task has run. Tasks may
//! borrow from the caller's stack: `run` does not return (nor unwind) while any worker can still
//! touch the job.
//!
//! Synchronisation is a generation counter that workers spin on briefly and then sleep on (a
//! condvar), an atomic task counter that workers claim tasks from, and an `active` count that the
//! caller waits on before returning. A call from inside a task (nested parallelism), or on a
//! one-thread pool, runs the tasks inline on the calling thread.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::error::{KernelError, Result};

/// Spins a worker makes, checking for new work, before it sleeps on the condvar. A model's
/// forward pass issues matmuls back to back with a few to tens of microseconds of other work
/// (norms, RoPE, attention) between them; at ~25 ns per `spin_loop` (PAUSE on Zen 4), 2000
/// spins cover about 50 us, so a worker is usually still awake for the next matmul (a futex
/// wake-up costs 5-50 us), while an idle pool stops burning a core almost at once: the
/// appliance shares its cores with the HTTP server, the retriever and other kernels' threads.
const SPIN_ITERS: u32 = 2_000;

/// Spins the caller makes waiting for workers to finish their last task before it starts to
/// `yield_now` (a worker may have been descheduled mid-task on a busy machine).
const WAIT_SPIN_ITERS: u32 = 1_000;

thread_local! {
    /// Set while this thread runs tasks of some pool: a nested `run` then executes inline, since
    /// the pool's workers may all be busy with the outer job.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// One `run` call's job, living on the caller's stack for the duration of the call.
struct Job<'f> {
    f: &'f (dyn Fn(usize) + Sync),
    n_tasks: usize,
    /// Next task index to hand out.
    next: AtomicUsize,
    /// The first panic payload of a task, re-raised on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left; a panicking task is recorded, not propagated.
    fn work(&self) {
        let was = IN_TASK.with(|c| c.replace(true));
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n_tasks {
                break;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
                slot.get_or_insert(p);
                // Skip the remaining tasks: the call will panic anyway.
                self.next.store(self.n_tasks, SeqCst);
            }
        }
        IN_TASK.with(|c| c.set(was));
    }
}

/// State shared between the pool handle and its workers.
struct Shared {
    /// Bumped once per published job (and at shutdown); workers wait for it to change.
    generation: AtomicUsize,
    /// The current job (type-erased `*const Job`), or null between jobs.
    job: AtomicPtr<()>,
    /// Workers that may be reading `job` or running its tasks.
    active: AtomicUsize,
    /// Workers asleep (or about to sleep) on `wake`.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

/// A fixed set of worker threads that run scoped parallel-for jobs ([`ThreadPool::run`]).
///
/// Create one per process (or per model) and share it: it is `Send + Sync`, and concurrent
/// `run` calls from different threads are serialised. Dropping the pool stops its workers.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises `run` calls from different threads (one job slot).
    submit: Mutex<()>,
    n_threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool of `n_threads` compute threads (0 counts as 1): the caller of [`run`](Self::run)
    /// plus `n_threads - 1` spawned workers. Fails only if the OS refuses to spawn a thread.
    pub fn new(n_threads: usize) -> Result<ThreadPool> {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            job: AtomicPtr::new(ptr::null_mut()),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = ThreadPool {
            shared: shared.clone(),
            workers: Vec::with_capacity(n_threads - 1),
            submit: Mutex::new(()),
            n_threads,
        };
        for i in 1..n_threads {
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("engram-kernel-{i}"))
                .spawn(move || worker(&shared))
                .map_err(|e| KernelError::ThreadSpawn {
                    threads: n_threads,
                    reason: e.to_string(),
                })?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Number of compute threads, the caller of `run` included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the pool's threads (the caller
    /// included), and returns when all have finished. Each index runs exactly once; the order
    /// and the thread are unspecified. If a task panics, the remaining unclaimed tasks are
    /// skipped and the first panic is resumed on the caller once every running task is done.
    ///
    /// Called from inside a task (of any pool), or on a one-thread pool, the tasks run inline in
    /// index order.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if self.n_threads == 1 || n_tasks == 1 || IN_TASK.with(Cell::get) {
            (0..n_tasks).for_each(f);
            return;
        }
        let _submit = self.submit.lock().unwrap_or_else(PoisonError::into_inner);
        let job = Job {
            f: &f,
            n_tasks,
            next: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let sh = &*self.shared;
        sh.job.store(&job as *const Job<'_> as *mut (), SeqCst);
        sh.generation.fetch_add(1, SeqCst);
        if sh.sleepers.load(SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.wake.notify_all();
        }
        job.work();
        // Retire the job: a worker that sees null afterwards never touches it, and one that
        // loaded the pointer before this store is counted in `active` (it increments `active`
        // before loading `job`, and both sides use SeqCst), so waiting for `active == 0` makes
        // `job` unreachable before it is dropped.
        sh.job.store(ptr::null_mut(), SeqCst);
        let mut spins = 0u32;
        while sh.active.load(SeqCst) != 0 {
            if spins < WAIT_SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let panic = job
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

impl ThreadPool {
    /// `f(i)` for every `i` in `0..n` on the pool (as [`run`](Self::run)), the results in index
    /// order.
    pub fn map<T: Send, F: Fn(usize) -> T + Sync>(&self, n: usize, f: F) -> Vec<T> {
        let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
        self.run(n, |i| {
            let v = f(i);
            *slots[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(v);
        });
        slots
            .into_iter()
            .map(|s| {
                s.into_inner()
                    .unwrap_or_else(PoisonError::into_inner)
                    .expect("ThreadPool::run runs every task")
            })
            .collect()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, SeqCst);
        sh.generation.fetch_add(1, SeqCst);
        {
            let _g = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker never panics (tasks are caught), so a join error is impossible.
            let _ = w.join();
        }
    }
}

/// A worker's loop: wait for a new generation, help with its job, repeat until shutdown.
///
/// `seen` starts at 0, the generation at creation, not at whatever the thread finds when it
/// first runs: a thread scheduled late must still notice every job and the shutdown that were
/// published before it started.
fn worker(sh: &Shared) {
    let mut seen = 0;
    loop {
        // Wait for a new generation: spin, then sleep.
        let mut spins = 0u32;
        loop {
            let g = sh.generation.load(SeqCst);
            if g != seen {
                seen = g;
                break;
            }
            if spins < SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let guard = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.sleepers.fetch_add(1, SeqCst);
            // Re-check after announcing ourselves: `run` bumps `generation` before it reads
            // `sleepers`, so either it sees us and notifies (under `lock`, which we hold until
            // `wait` releases it) or we see its generation here.
            let guard = if sh.generation.load(SeqCst) == seen {
                sh.wake.wait(guard).unwrap_or_else(PoisonError::into_inner)
            } else {
                guard
            };
            sh.sleepers.fetch_sub(1, SeqCst);
            drop(guard);
        }
        if sh.shutdown.load(SeqCst) {
            return;
        }
        sh.active.fetch_add(1, SeqCst);
        let p = sh.job.load(SeqCst) as *const Job<'_>;
        if !p.is_null() {
            // SAFETY: `p` was published by `run`, which keeps the job alive until it has stored
            // null into `job` and then seen `active == 0`; we incremented `active` before loading
            // `p` (SeqCst on both sides), so `run` is still waiting for us.
            unsafe { (*p).work() };
        }
        sh.active.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3, 8] {
            let pool = ThreadPool::new(threads).unwrap();
            for n in [0, 1, 2, 5, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, |i| {
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "{threads} {n}");
            }
        }
    }

    #[test]
    fn map_returns_every_result_in_index_order() {
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            assert_eq!(
                pool.map(50, |i| i * 2),
                (0..50).map(|i| i * 2).collect::<Vec<_>>()
            );
            assert!(pool.map(0, |i| i).is_empty());
        }
    }

    #[test]
    fn serial_reuse_and_borrowed_output() {
        let pool = ThreadPool::new(3).unwrap();
        let mut out = vec![0usize; 64];
        for round in 0..200 {
            let cells: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            pool.run(64, |i| cells[i].store(i * round, SeqCst));
            for (o, c) in out.iter_mut().zip(&cells) {
                *o = c.load(SeqCst);
            }
            assert!(out.iter().enumerate().all(|(i, &v)| v == i * round));
        }
    }

    #[test]
    fn nested_run_executes_inline() {
        let pool = ThreadPool::new(2).unwrap();
        let total = AtomicUsize::new(0);
        pool.run(4, |_| {
            pool.run(5, |j| {
                total.fetch_add(j, SeqCst);
            });
        });
        assert_eq!(total.load(SeqCst), 4 * 10);
    }

    #[test]
    fn one_thread_pool_runs_inline_in_order() {
        let pool = ThreadPool::new(1).unwrap();
        let me = std::thread::current().id();
        let order = Mutex::new(Vec::new());
        pool.run(5, |i| {
            assert_eq!(std::thread::current().id(), me);
            order.lock().unwrap().push(i);
        });
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn panics_propagate_and_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(50, |i| {
                if i == 17 {
                    panic!("task 17");
                }
            })
        }));
        let msg = r.unwrap_err();
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 17"));
        let n = AtomicUsize::new(0);
        pool.run(10, |_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 10);
    }

    #[test]
    fn concurrent_callers_are_serialised() {
        let pool = Arc::new(ThreadPool::new(2).unwrap());
        std::thread::scope(|s| {
            for k in 0..3 {
                let pool = pool.clone();
                s.spawn(move || {
                    for _ in 0..50 {
                        let sum = AtomicUsize::new(0);
                        pool.run(20, |i| {
                            sum.fetch_add(i + k, SeqCst);
                        });
                        assert_eq!(sum.load(SeqCst), 190 + 20 * k);
                    }
                });
            }
        });
    }

    #[test]
    fn sleeping_workers_wake_up() {
        let pool = ThreadPool::new(3).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let ids = Mutex::new(std::collections::HashSet::new());
        pool.run(300, |_| {
            ids.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(std::time::Duration::from_micros(100));
        });
        assert!(ids.lock().unwrap().len() >= 2);
    }

    #[test]
    fn pool_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<ThreadPool>();
    }
}
