/* Peak heap bytes of a process, for scripts/bench_cpu.sh: LD_PRELOAD this library and read
 * heap_peak_reset() / heap_peak() (ctypes.CDLL(None)) around the code measured. Every
 * malloc family call is counted by malloc_usable_size, so the figure is what the program
 * held from the C heap (PyTorch's CPU tensors come from posix_memalign), not its RSS. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static _Atomic long current, peak;

static void* held(void* p) {
  if (p) {
    const long now = atomic_fetch_add(&current, (long)malloc_usable_size(p)) + (long)malloc_usable_size(p);
    long seen = atomic_load(&peak);
    while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {
    }
  }
  return p;
}
static void released(void* p) {
  if (p) atomic_fetch_sub(&current, (long)malloc_usable_size(p));
}

void* malloc(size_t n) { return held(__libc_malloc(n)); }
void* calloc(size_t count, size_t n) { return held(__libc_calloc(count, n)); }
void free(void* p) {
  released(p);
  __libc_free(p);
}
void* realloc(void* old, size_t n) {
  released(old);
  void* p = __libc_realloc(old, n);
  if (!p && n) held(old); /* failed: the old block stays */
  return held(p);
}
void* memalign(size_t alignment, size_t n) { return held(__libc_memalign(alignment, n)); }
void* aligned_alloc(size_t alignment, size_t n) { return held(__libc_memalign(alignment, n)); }
int posix_memalign(void** out, size_t alignment, size_t n) {
  void* p = __libc_memalign(alignment, n);
  if (!p) return ENOMEM;
  *out = held(p);
  return 0;
}

long heap_current(void) { return atomic_load(&current); }
long heap_peak(void) { return atomic_load(&peak); }
/* Starts a new peak from what is held now; returns that. */
long heap_peak_reset(void) {
  const long now = atomic_load(&current);
  atomic_store(&peak, now);
  return now;
}
