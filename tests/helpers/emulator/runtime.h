// The GPU emulators' runtime (tests/gpu_emulator.py): a kernel body compiled as C++ runs with one
// thread of execution (its own stack and registers) per GPU thread, a threadgroup (CUDA block) at
// a time. The threads are fibers switched on one CPU thread, by a fixed schedule:
//
// - Each thread runs until it reaches a barrier, a simdgroup operation or its end, then the next
//   one runs: between two barriers the threads run one after the other, in index order (or the
//   reverse). A missing barrier is then never hidden by timing: a read of memory another thread
//   writes before the barrier always sees the old value in one of the two orders. With
//   EMULATOR_ORDERS=2 (the default) every launch runs in both orders, and outputs that differ
//   between them are reported as a race.
// - Threadgroup memory (the kernel's threadgroup arrays, `regions`) and outputs start filled with
//   0xff bytes (NaN for floats), as a GPU leaves them unset; uninitialized locals are a fixed
//   pattern (-ftrivial-auto-var-init=pattern). Device buffers end at an unmapped page: a read or
//   write past an input or output stops the program.
// - A barrier must be reached by every thread of the threadgroup at the same call site, and a
//   simdgroup operation by every lane of the simdgroup still running; a lane that has returned,
//   or does not exist (a partial simdgroup), contributes 0xff bytes to shuffles.
//
// The CUDA emulator first ran one std::thread a GPU thread with std::barrier: every barrier and
// shuffle cost a futex wake-up per thread, on CI's two shared cores the bulk of the suite's
// kernel tests, and the OS chose the schedule, so a race showed only by chance. Fibers make every
// run repeatable.
#pragma once

#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

namespace emu {

constexpr int kLanes = 32;          // threads a simdgroup (CUDA: a warp)
constexpr int kMaxThreads = 1024;   // threads a threadgroup
constexpr size_t kStack = 128 << 10;
constexpr unsigned char kPoison = 0xff;

[[noreturn]] inline void fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fputs("emulator: ", stderr);
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
  fflush(stderr);
  _exit(3);
}

enum State { kReady, kBarrier, kSimd, kDone };

// Switching between threads. On x86-64 a few instructions save the callee-saved registers on
// the running stack and load another's (swapcontext also saves the signal mask, a system call
// each way, and a tree attention launch switches a million times); elsewhere ucontext.
#if defined(__x86_64__)
struct Context {
  void* sp;
};
extern "C" void emu_switch(Context* from, Context* to);
asm(R"(
.text
.globl emu_switch
.type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq (%rsi), %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");
inline void switch_to(Context* from, Context* to) { emu_switch(from, to); }
// A context that starts `entry` on the stack [stack, stack + bytes): its first switch pops six
// registers and returns into entry, with the stack aligned as after a call.
inline void start_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
  void** top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15)));
  top[-1] = nullptr;
  top[-2] = reinterpret_cast<void*>(entry);
  for (int i = 3; i <= 8; ++i) top[-i] = nullptr;
  c->sp = top - 8;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
inline void start_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = bytes;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
}
#endif

struct Thread {
  Context context;
  State state;
};

struct Simdgroup {
  int live;         // lanes still running
  int waiting;      // lanes at the current operation
  int parity;       // the slots the current operation fills; the previous one's may still be read
  unsigned arrived;
  unsigned took_part[2];
  int site;
  alignas(16) unsigned char slots[2][kLanes][16];
};

struct Team {
  int size, live, waiting, current;
  bool reverse;
  int site;
  int group[3];  // the threadgroup's position in the grid
  void (*body)(int);
  char* stacks;
  Context scheduler;
  Thread threads[kMaxThreads];
  Simdgroup simd[kMaxThreads / kLanes];
};
inline Team team;

// Threadgroup memory: the kernel's threadgroup (__shared__) arrays, static variables of the kernel
// function. g++ ignores a section attribute on the static variables of a function template, so
// tests/gpu_emulator.py finds them in the program's symbol table and sends their places (from
// `team`, in the same segment) and sizes.
struct Region {
  int64_t offset, bytes;
};
inline Region regions[64];
inline int region_count;
inline size_t threadgroup_bytes() {
  size_t total = 0;
  for (int i = 0; i < region_count; ++i) total += size_t(regions[i].bytes);
  return total;
}
inline void poison_threadgroup_memory() {
  for (int i = 0; i < region_count; ++i) memset(reinterpret_cast<char*>(&team) + regions[i].offset, kPoison, size_t(regions[i].bytes));
}

inline void yield(State state) {
  Thread& t = team.threads[team.current];
  t.state = state;
  switch_to(&t.context, &team.scheduler);
}

// A threadgroup barrier (threadgroup_barrier, __syncthreads) at `site`, the caller's line in the
// source (__builtin_LINE as a default argument): compiled code may duplicate a call, so its return
// address would not do.
inline void barrier(int site) {
  if (team.live < team.size) {
    fail("threadgroup (%d, %d, %d): thread %d reaches a barrier after another thread returned; every thread must reach every barrier",
         team.group[0], team.group[1], team.group[2], team.current);
  }
  if (team.waiting == 0) {
    team.site = site;
  } else if (team.site != site) {
    fail("threadgroup (%d, %d, %d): threads wait at two different barriers (a barrier in divergent control flow)",
         team.group[0], team.group[1], team.group[2]);
  }
  if (++team.waiting == team.size) {
    team.waiting = 0;
    for (int i = 0; i < team.size; ++i) {
      if (team.threads[i].state == kBarrier) team.threads[i].state = kReady;
    }
    yield(kReady);  // the next pass runs every thread again in schedule order
  } else {
    yield(kBarrier);
  }
}

inline void complete(Simdgroup& g, int first) {
  const int p = g.parity;
  g.took_part[p] = g.arrived;
  for (int l = 0; l < kLanes; ++l) {
    if (!(g.arrived >> l & 1)) memset(g.slots[p][l], kPoison, 16);
  }
  g.arrived = 0;
  g.waiting = 0;
  g.parity ^= 1;
  for (int l = 0; l < kLanes && first + l < team.size; ++l) {
    if (team.threads[first + l].state == kSimd) team.threads[first + l].state = kReady;
  }
}

// One simdgroup operation at `site`: every running lane deposits `bytes` of its value; returns
// the 32 lanes' slots (16 bytes each) and, in *took_part, the lanes that deposited one.
inline const unsigned char* simd_exchange(const void* value, int bytes, int site, unsigned* took_part) {
  const int t = team.current, first = t / kLanes * kLanes;
  Simdgroup& g = team.simd[t / kLanes];
  if (g.waiting == 0) {
    g.site = site;
  } else if (g.site != site) {
    fail("threadgroup (%d, %d, %d): lanes of simdgroup %d wait at two different simdgroup operations (divergent control flow)",
         team.group[0], team.group[1], team.group[2], t / kLanes);
  }
  const int p = g.parity;
  memcpy(g.slots[p][t % kLanes], value, bytes);
  g.arrived |= 1u << (t % kLanes);
  if (++g.waiting == g.live) {
    complete(g, first);
    yield(kReady);
  } else {
    yield(kSimd);
  }
  *took_part = g.took_part[p];
  return g.slots[p][0];
}

inline void finish_thread() {
  const int t = team.current;
  team.threads[t].state = kDone;
  --team.live;
  if (team.waiting) {
    fail("threadgroup (%d, %d, %d): thread %d returns while others wait at a barrier; every thread must reach every barrier",
         team.group[0], team.group[1], team.group[2], t);
  }
  Simdgroup& g = team.simd[t / kLanes];
  --g.live;
  if (g.waiting && g.waiting == g.live) complete(g, t / kLanes * kLanes);
}

[[noreturn]] inline void start_thread() {
  team.body(team.current);
  finish_thread();
  switch_to(&team.threads[team.current].context, &team.scheduler);  // never resumed
  __builtin_unreachable();
}

// Run `size` threads of the threadgroup at `group` to their end.
inline void run_team(int size, const int group[3], bool reverse) {
  if (size > kMaxThreads) fail("%d threads a threadgroup, more than %d", size, kMaxThreads);
  team.size = team.live = size;
  team.waiting = 0;
  team.reverse = reverse;
  memcpy(team.group, group, sizeof team.group);
  for (int s = 0; s * kLanes < size; ++s) {
    Simdgroup& g = team.simd[s];
    g.live = size - s * kLanes < kLanes ? size - s * kLanes : kLanes;
    g.waiting = g.parity = 0;
    g.arrived = 0;
    memset(g.slots, kPoison, sizeof g.slots);
  }
  poison_threadgroup_memory();
  for (int t = 0; t < size; ++t) {
    start_context(&team.threads[t].context, team.stacks + t * kStack, kStack, start_thread);
    team.threads[t].state = kReady;
  }
  for (int done = 0; done < size;) {
    bool ran = false;
    done = 0;
    for (int k = 0; k < size; ++k) {
      const int t = reverse ? size - 1 - k : k;
      if (team.threads[t].state == kReady) {
        team.current = t;
        switch_to(&team.scheduler, &team.threads[t].context);
        ran = true;
      }
      done += team.threads[t].state == kDone;
    }
    if (!ran && done < size) {
      fail("threadgroup (%d, %d, %d): deadlock, %d threads wait at barriers or simdgroup operations that the others never reach",
           group[0], group[1], group[2], size - done);
    }
  }
}

// ---------------------------------------------------------------------------------- buffers

struct Buffer {
  char* data;
  size_t bytes;
  bool output;
  unsigned char fill[16];  // an output's initial element (0xff bytes unless init_value is given)
  size_t fill_bytes;
};
inline Buffer buffers[64];
inline int buffer_count;

inline void on_fault(int) {
  static const char message[] = "emulator: a thread read or wrote past the end of a device buffer\n";
  if (write(2, message, sizeof message - 1) < 0) _exit(4);
  _exit(4);
}

inline size_t page_size() { return size_t(sysconf(_SC_PAGESIZE)); }

// `bytes` of memory ending where an unmapped page begins.
inline char* guarded(size_t bytes) {
  const size_t page = page_size(), span = (bytes + page - 1) / page * page;
  char* base = static_cast<char*>(mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) fail("out of memory for a %zu-byte buffer", bytes);
  mprotect(base + span, page, PROT_NONE);
  return base + span - bytes;
}

inline void read_exactly(void* to, size_t bytes) {
  if (bytes && fread(to, 1, bytes, stdin) != bytes) fail("short input");
}

inline int64_t read_int() {
  int64_t v;
  read_exactly(&v, sizeof v);
  return v;
}

// stdin: the threadgroup arrays' count, then each one's offset from `team` and bytes; the buffer
// count, then per buffer its bytes, whether it is an output and its element bytes, then its
// contents (inputs) or its initial element (outputs).
inline void read_buffers() {
  region_count = int(read_int());
  for (int i = 0; i < region_count; ++i) regions[i] = {read_int(), read_int()};
  buffer_count = int(read_int());
  for (int i = 0; i < buffer_count; ++i) {
    Buffer& b = buffers[i];
    b.bytes = size_t(read_int());
    b.output = read_int() != 0;
    b.fill_bytes = size_t(read_int());
    b.data = guarded(b.bytes);
    read_exactly(b.output ? static_cast<void*>(b.fill) : static_cast<void*>(b.data), b.output ? b.fill_bytes : b.bytes);
  }
}

inline void fill_outputs() {
  for (int i = 0; i < buffer_count; ++i) {
    Buffer& b = buffers[i];
    for (size_t at = 0; b.output && at + b.fill_bytes <= b.bytes; at += b.fill_bytes) memcpy(b.data + at, b.fill, b.fill_bytes);
  }
}

// Run every threadgroup of the grid `groups` (x, y, z), `size(g)` threads each, once in each
// schedule order (EMULATOR_ORDERS, default 2), check that both give the same outputs, and
// write the outputs to stdout.
inline void run_grid(const int groups[3], int (*size)(const int*), void (*body)(int)) {
  if (threadgroup_bytes() > (32u << 10)) {
    fail("the kernel declares %zu bytes of threadgroup memory, more than the 32 KiB of Apple GPUs", threadgroup_bytes());
  }
  stack_t alt;
  alt.ss_sp = malloc(SIGSTKSZ * 4);
  alt.ss_size = SIGSTKSZ * 4;
  alt.ss_flags = 0;
  sigaltstack(&alt, nullptr);
  struct sigaction action = {};
  action.sa_handler = on_fault;
  action.sa_flags = SA_ONSTACK;
  sigaction(SIGSEGV, &action, nullptr);
  sigaction(SIGBUS, &action, nullptr);

  int most = 1;
  for (int z = 0; z < groups[2]; ++z) {
    for (int y = 0; y < groups[1]; ++y) {
      for (int x = 0; x < groups[0]; ++x) {
        const int g[3] = {x, y, z};
        if (size(g) > most) most = size(g);
      }
    }
  }
  team.body = body;
  team.stacks = static_cast<char*>(mmap(nullptr, most * kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  const char* env = getenv("EMULATOR_ORDERS");
  const int orders = env ? atoi(env) : 2;
  char* first[64] = {};
  for (int order = 0; order < orders; ++order) {
    fill_outputs();
    for (int z = 0; z < groups[2]; ++z) {
      for (int y = 0; y < groups[1]; ++y) {
        for (int x = 0; x < groups[0]; ++x) {
          const int g[3] = {x, y, z};
          run_team(size(g), g, order == 1);
        }
      }
    }
    for (int i = 0, output = 0; i < buffer_count; ++i) {
      const Buffer& b = buffers[i];
      if (!b.output) continue;
      ++output;
      if (order == 0) {
        first[i] = static_cast<char*>(malloc(b.bytes + 1));
        memcpy(first[i], b.data, b.bytes);
      } else if (memcmp(first[i], b.data, b.bytes)) {
        size_t at = 0;
        while (first[i][at] == b.data[at]) ++at;
        fail("output %d differs between two orders of running the threads (byte %zu): a race, such as a missing barrier", output - 1, at);
      }
    }
  }
  for (int i = 0; i < buffer_count; ++i) {
    if (buffers[i].output && fwrite(buffers[i].data, 1, buffers[i].bytes, stdout) != buffers[i].bytes) fail("short output");
  }
  fflush(stdout);
}

}  // namespace emu
