// The host experts of one hybrid MoE layer as a pair of XLA FFI custom calls,
// "jds_host_experts_start" and "jds_host_experts_finish".
//
// start: x [..., D] (bf16 or f32), ids [..., K] int32, weights [..., K] f32 -> pending [..., D] f32:
// the sum over k of the experts that live in the registered bank (jds_moe_forward of _kernel.cc,
// compiled into the same library), each distinct bank expert read once; an id the bank does not hold
// (another slot's, or -1) adds nothing. Attributes: bank (the key a bank was registered under),
// limit, round_bf16, threads, tile_f, tile_d, prefetch.
// finish: pending -> y, the same buffer (aliased), once the host part is in it.
// Between the two, the program runs what does not need the host's result (the layer's device
// experts, its PCIe share), so the GPU and the CPU work at once.
//
// The plan (pairs sorted by bank slot, stable, as cpu_gemv.Plan sorts them) is built here, so no
// Python runs in the round trip.
//   - CPU: start computes y where XLA calls it; finish does nothing.
//   - CUDA: start only enqueues: on the step's stream the copies of x, ids and weights to pinned
//     staging and an event; on a side stream a wait for that event, a host function
//     (cuLaunchHostFunc) that runs the plan and the GEMV on the CUDA driver's callback thread, the
//     copy of y into `pending` and a `done` event. finish makes the step's stream wait for `done`.
//     The thread that runs the executable never waits: it goes on launching the rest of the step
//     (and the next step). The driver API is found with dlsym (no CUDA headers or libraries at build
//     time). Staging is per (bank, rows), reused in stream order.
// A bank is looked up by key when the handler runs; an unknown key is an error of the call. A host
// function that fails writes NaN into y and makes the next call of that bank fail with its code.

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int jds_moe_forward(int fmt, const uint8_t* data, const int64_t* stride, const int64_t* off,
                               int D, int F, int R, int K, const float* x,
                               int n_uniq, const int32_t* uniq_slot, const int32_t* pstart,
                               const int32_t* pair_row, const float* pair_w, const int32_t* pair_out,
                               const uint8_t* covered, float* xp, float* h, float* out, float* y,
                               float limit, int round_bf16, int nthreads, int tile_f, int tile_d, int use_simd,
                               int prefetch);

namespace {

struct Bank {
  int fmt;
  const uint8_t* data;
  int64_t stride[6], off[6];
  int D, F, n_experts, n_slots;
  std::vector<int32_t> slot_of;
  std::atomic<int64_t> calls{0}, ns{0}, experts{0};
  std::atomic<int> failed{0};
  // host functions enqueued and not yet finished: releasing the bank (its memory is about to be
  // freed) waits for them
  int inflight = 0;
  std::mutex m;
  std::condition_variable idle;
};

std::mutex g_lock;
std::map<int64_t, std::vector<std::shared_ptr<Bank>>> g_banks;  // key -> live registrations, latest last

std::shared_ptr<Bank> find_bank(int64_t key) {
  std::lock_guard<std::mutex> guard(g_lock);
  auto it = g_banks.find(key);
  if (it == g_banks.end() || it->second.empty()) return nullptr;
  return it->second.back();
}

struct Launch {  // what one call needs besides its buffers
  float limit;
  int round_bf16, threads, tile_f, tile_d, prefetch;
};

// Scratch of one call: the plan and the kernel's work arrays.
struct Work {
  std::vector<float> xf, xp, h, out, pw;
  std::vector<int32_t> uniq, pstart, prow, pout, count;
  std::vector<uint8_t> covered;
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// y [R, D] = the bank's part of the layer for rows x (bf16 bits or f32), ids / w [R, K]. 0 or the
// kernel's error code.
int host_experts(Bank& b, const void* x, bool x_bf16, const int32_t* ids, const float* w, int R, int K, float* y,
                 const Launch& a, Work& s) {
  const auto start = std::chrono::steady_clock::now();
  const int P = R * K, D = b.D;
  // the plan: a stable counting sort of the pairs whose expert lives in the bank, by bank slot
  s.count.assign(b.n_slots + 1, 0);
  s.covered.assign(P, 0);
  int n_pairs = 0;
  for (int p = 0; p < P; ++p) {
    const int e = ids[p];
    const int slot = (e >= 0 && e < b.n_experts) ? b.slot_of[e] : -1;
    if (slot >= 0) { ++s.count[slot + 1]; ++n_pairs; }
  }
  s.uniq.clear();
  s.pstart.clear();
  for (int slot = 0; slot < b.n_slots; ++slot) {
    if (s.count[slot + 1]) { s.uniq.push_back(slot); s.pstart.push_back(s.count[slot]); }
    s.count[slot + 1] += s.count[slot];
  }
  s.pstart.push_back(n_pairs);
  s.prow.resize(n_pairs);
  s.pout.resize(n_pairs);
  s.pw.resize(n_pairs);
  for (int p = 0; p < P; ++p) {
    const int e = ids[p];
    const int slot = (e >= 0 && e < b.n_experts) ? b.slot_of[e] : -1;
    if (slot < 0) continue;
    const int at = s.count[slot]++;
    s.pout[at] = p;
    s.prow[at] = p / K;
    s.pw[at] = w[p];
    s.covered[p] = 1;
  }
  int rc = 0;
  if (n_pairs == 0) {
    std::memset(y, 0, sizeof(float) * size_t(R) * D);
  } else {
    const float* xf = static_cast<const float*>(x);
    if (x_bf16) {
      s.xf.resize(size_t(R) * D);
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      for (size_t i = 0; i < s.xf.size(); ++i) s.xf[i] = bf16_to_f32(xb[i]);
      xf = s.xf.data();
    }
    s.xp.resize(size_t(R) * D);
    s.h.resize(size_t(n_pairs) * b.F);
    s.out.resize(size_t(P) * D);
    rc = jds_moe_forward(b.fmt, b.data, b.stride, b.off, D, b.F, R, K, xf, int(s.uniq.size()), s.uniq.data(),
                         s.pstart.data(), s.prow.data(), s.pw.data(), s.pout.data(), s.covered.data(), s.xp.data(),
                         s.h.data(), s.out.data(), y, a.limit, a.round_bf16, a.threads, a.tile_f, a.tile_d, 1,
                         a.prefetch);
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  b.calls += 1;
  b.ns += ns.count();
  b.experts += int64_t(s.uniq.size());
  return rc;
}

struct Shape {
  int rows, k;
  bool x_bf16;
};

ffi::Error check(const Bank* bank, int64_t key, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, Shape& shape) {
  if (!bank) return ffi::Error::InvalidArgument("jds_host_experts: no host bank is registered under key " +
                                                std::to_string(key) + " (register it in this process first)");
  if (int err = bank->failed.load())
    return ffi::Error::Internal("jds_host_experts: an earlier host call of this bank failed with code " +
                                std::to_string(err));
  const auto xd = x.dimensions(), idd = ids.dimensions();
  if (xd.size() < 1 || idd.size() < 1 || xd.back() != bank->D)
    return ffi::Error::InvalidArgument("jds_host_experts: x must be [..., " + std::to_string(bank->D) + "]");
  shape.x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (!shape.x_bf16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jds_host_experts: x must be bfloat16 or float32");
  shape.k = int(idd.back());
  shape.rows = int(x.element_count() / bank->D);
  if (int64_t(shape.rows) * shape.k != int64_t(ids.element_count()))
    return ffi::Error::InvalidArgument("jds_host_experts: ids must be [rows, K] for the rows of x");
  return ffi::Error::Success();
}

// ---- CPU ---------------------------------------------------------------------------------------

// start computes y where XLA calls it; finish has nothing left to do (its output aliases its input).
ffi::Error StartCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y, int64_t key, float limit, int32_t round_bf16,
                    int32_t threads, int32_t tile_f, int32_t tile_d, int32_t prefetch) {
  auto bank = find_bank(key);
  Shape shape;
  if (auto err = check(bank.get(), key, x, ids, shape); err.failure()) return err;
  Work work;
  const Launch a{limit, round_bf16, threads, tile_f, tile_d, prefetch};
  const int rc = host_experts(*bank, x.untyped_data(), shape.x_bf16, ids.typed_data(), w.typed_data(), shape.rows,
                              shape.k, y->typed_data(), a, work);
  if (rc) return ffi::Error::Internal("jds_host_experts: the CPU expert kernel failed with code " + std::to_string(rc));
  return ffi::Error::Success();
}

ffi::Error FinishCpu(ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>, int64_t) { return ffi::Error::Success(); }

// ---- CUDA (driver API through dlsym) ------------------------------------------------------------

using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUevent = void*;
using CUdeviceptr = unsigned long long;

struct Driver {
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*launch_host_func)(CUstream, void (*)(void*), void*) = nullptr;
  CUresult (*host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*stream_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return d;
    d.memcpy_dtoh = (decltype(d.memcpy_dtoh))dlsym(lib, "cuMemcpyDtoHAsync_v2");
    d.memcpy_htod = (decltype(d.memcpy_htod))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    d.launch_host_func = (decltype(d.launch_host_func))dlsym(lib, "cuLaunchHostFunc");
    d.host_alloc = (decltype(d.host_alloc))dlsym(lib, "cuMemHostAlloc");
    d.stream_ctx = (decltype(d.stream_ctx))dlsym(lib, "cuStreamGetCtx");
    d.ctx_push = (decltype(d.ctx_push))dlsym(lib, "cuCtxPushCurrent_v2");
    d.ctx_pop = (decltype(d.ctx_pop))dlsym(lib, "cuCtxPopCurrent_v2");
    d.stream_create = (decltype(d.stream_create))dlsym(lib, "cuStreamCreate");
    d.event_create = (decltype(d.event_create))dlsym(lib, "cuEventCreate");
    d.event_record = (decltype(d.event_record))dlsym(lib, "cuEventRecord");
    d.stream_wait_event = (decltype(d.stream_wait_event))dlsym(lib, "cuStreamWaitEvent");
    d.ok = d.memcpy_dtoh && d.memcpy_htod && d.launch_host_func && d.host_alloc && d.stream_ctx && d.ctx_push &&
           d.ctx_pop && d.stream_create && d.event_create && d.event_record && d.stream_wait_event;
    return d;
  }();
  return d;
}

// Pinned buffers, scratch and events of one (bank, rows): written in stream order only. `inputs`
// is recorded on the step's stream once x, ids and w are in `x`, `ids`, `w`; `done` on the side
// stream once y is back on the device.
struct Staging {
  std::shared_ptr<Bank> bank;
  Shape shape;
  Launch launch;
  void* x = nullptr;
  int32_t* ids = nullptr;
  float* w = nullptr;
  float* y = nullptr;
  size_t x_bytes = 0, y_bytes = 0;
  CUevent inputs = nullptr, done = nullptr;
  Work work;
};

std::map<std::pair<const Bank*, int>, std::unique_ptr<Staging>> g_staging;
std::map<CUcontext, CUstream> g_side;  // the side stream of each context, where host parts run

void run_staged(void* p) {  // the host function: runs on the driver's callback thread, no CUDA calls
  Staging& st = *static_cast<Staging*>(p);
  const int rc = host_experts(*st.bank, st.x, st.shape.x_bf16, st.ids, st.w, st.shape.rows, st.shape.k, st.y,
                              st.launch, st.work);
  if (rc) {
    const size_t n = st.y_bytes / sizeof(float);
    for (size_t i = 0; i < n; ++i) st.y[i] = std::numeric_limits<float>::quiet_NaN();
    st.bank->failed = rc;
  }
  std::lock_guard<std::mutex> guard(st.bank->m);
  if (--st.bank->inflight == 0) st.bank->idle.notify_all();
}

std::string cu_error(const char* what, CUresult rc) {
  return std::string("jds_host_experts: ") + what + " failed with CUDA error " + std::to_string(rc);
}

// The staging of (bank, rows) and the side stream of `stream`'s context, made at first use
// (with that context current).
ffi::Error staging_for(const Driver& d, CUstream stream, std::shared_ptr<Bank> bank, const Shape& shape,
                       Staging*& out, CUstream& side) {
  std::lock_guard<std::mutex> guard(g_lock);
  CUcontext ctx = nullptr;
  if (CUresult rc = d.stream_ctx(stream, &ctx)) return ffi::Error::Internal(cu_error("cuStreamGetCtx", rc));
  auto& slot = g_staging[{bank.get(), shape.rows}];
  auto& side_slot = g_side[ctx];
  const bool fresh = !slot || slot->shape.k != shape.k || slot->shape.x_bf16 != shape.x_bf16;
  if (fresh || !side_slot) {
    if (CUresult rc = d.ctx_push(ctx)) return ffi::Error::Internal(cu_error("cuCtxPushCurrent", rc));
    CUresult rc = 0;
    if (!side_slot) rc = d.stream_create(&side_slot, 1 /* CU_STREAM_NON_BLOCKING */);
    if (!rc && fresh) {
      auto st = std::make_unique<Staging>();
      st->bank = bank;
      st->shape = shape;
      st->x_bytes = size_t(shape.rows) * bank->D * (shape.x_bf16 ? 2 : 4);
      st->y_bytes = size_t(shape.rows) * bank->D * 4;
      const size_t pair_bytes = size_t(shape.rows) * shape.k * 4;
      auto align = [](size_t n) { return (n + 63) / 64 * 64; };
      void* mem = nullptr;  // never freed: one small buffer per (bank, rows), for the process's life
      rc = d.host_alloc(&mem, align(st->x_bytes) + align(st->y_bytes) + 2 * align(pair_bytes), 0);
      if (!rc) rc = d.event_create(&st->inputs, 2 /* CU_EVENT_DISABLE_TIMING */);
      if (!rc) rc = d.event_create(&st->done, 2);
      if (!rc) {
        auto* base = static_cast<char*>(mem);
        st->x = base;
        st->y = reinterpret_cast<float*>(base + align(st->x_bytes));
        st->ids = reinterpret_cast<int32_t*>(base + align(st->x_bytes) + align(st->y_bytes));
        st->w = reinterpret_cast<float*>(base + align(st->x_bytes) + align(st->y_bytes) + align(pair_bytes));
        slot = std::move(st);
      }
    }
    CUcontext popped;
    d.ctx_pop(&popped);
    if (rc) return ffi::Error::Internal(cu_error("making the host experts' staging", rc));
  }
  out = slot.get();
  side = side_slot;
  return ffi::Error::Success();
}

// start: on the step's stream, x, ids and w to pinned memory (so XLA may reuse their buffers at once)
// and an event; on the side stream, a wait for that event, the host function (plan + GEMV) and the
// copy of y into `pending`, then the `done` event. The step's stream goes on with the kernels XLA
// launches next (the layer's device experts, its PCIe share) while the host computes.
ffi::Error StartCuda(CUstream stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> pending, int64_t key, float limit, int32_t round_bf16,
                     int32_t threads, int32_t tile_f, int32_t tile_d, int32_t prefetch) {
  const Driver& d = driver();
  if (!d.ok) return ffi::Error::Internal("jds_host_experts: the CUDA driver API (libcuda.so.1) was not found");
  auto bank = find_bank(key);
  Shape shape;
  if (auto err = check(bank.get(), key, x, ids, shape); err.failure()) return err;
  Staging* st = nullptr;
  CUstream side = nullptr;
  if (auto err = staging_for(d, stream, bank, shape, st, side); err.failure()) return err;
  st->launch = Launch{limit, round_bf16, threads, tile_f, tile_d, prefetch};  // the executable's: fixed per call site
  const size_t pair_bytes = size_t(shape.rows) * shape.k * 4;
  CUresult rc = d.memcpy_dtoh(st->x, CUdeviceptr(x.untyped_data()), st->x_bytes, stream);
  if (!rc) rc = d.memcpy_dtoh(st->ids, CUdeviceptr(ids.untyped_data()), pair_bytes, stream);
  if (!rc) rc = d.memcpy_dtoh(st->w, CUdeviceptr(w.untyped_data()), pair_bytes, stream);
  if (!rc) rc = d.event_record(st->inputs, stream);
  if (!rc) rc = d.stream_wait_event(side, st->inputs, 0);
  if (!rc) {
    { std::lock_guard<std::mutex> guard(bank->m); ++bank->inflight; }
    rc = d.launch_host_func(side, run_staged, st);
    if (rc) { std::lock_guard<std::mutex> guard(bank->m); --bank->inflight; }
  }
  if (!rc) rc = d.memcpy_htod(CUdeviceptr(pending->untyped_data()), st->y, st->y_bytes, side);
  if (!rc) rc = d.event_record(st->done, side);
  if (rc) return ffi::Error::Internal(cu_error("enqueueing the host experts", rc));
  return ffi::Error::Success();
}

// finish: the step's stream waits for the `done` event of the start before it (same bank and rows);
// its output is its input (aliased), now holding y.
ffi::Error FinishCuda(CUstream stream, ffi::Buffer<ffi::F32> pending, ffi::ResultBuffer<ffi::F32>, int64_t key) {
  const Driver& d = driver();
  auto bank = find_bank(key);
  if (!bank) return ffi::Error::InvalidArgument("jds_host_experts_finish: no host bank is registered under key " +
                                                std::to_string(key));
  const int rows = int(pending.element_count() / bank->D);
  Staging* st = nullptr;
  {
    std::lock_guard<std::mutex> guard(g_lock);
    auto it = g_staging.find({bank.get(), rows});
    if (it != g_staging.end()) st = it->second.get();
  }
  if (!st) return ffi::Error::Internal("jds_host_experts_finish: no start of this bank and row count came before");
  if (CUresult rc = d.stream_wait_event(stream, st->done, 0)) return ffi::Error::Internal(cu_error("cuStreamWaitEvent", rc));
  return ffi::Error::Success();
}

}  // namespace

#define JDS_START_BIND(...)                                                                                    \
  ffi::Ffi::Bind()__VA_ARGS__.Arg<ffi::AnyBuffer>()                                                            \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                            \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                            \
      .Ret<ffi::Buffer<ffi::F32>>()                                                                            \
      .Attr<int64_t>("bank")                                                                                   \
      .Attr<float>("limit")                                                                                    \
      .Attr<int32_t>("round_bf16")                                                                             \
      .Attr<int32_t>("threads")                                                                                \
      .Attr<int32_t>("tile_f")                                                                                 \
      .Attr<int32_t>("tile_d")                                                                                 \
      .Attr<int32_t>("prefetch")
#define JDS_FINISH_BIND(...) \
  ffi::Ffi::Bind()__VA_ARGS__.Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("bank")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_start_cpu, StartCpu, JDS_START_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_start_cuda, StartCuda,
                              JDS_START_BIND(.Ctx<ffi::PlatformStream<void*>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_finish_cpu, FinishCpu, JDS_FINISH_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_finish_cuda, FinishCuda,
                              JDS_FINISH_BIND(.Ctx<ffi::PlatformStream<void*>>()));

extern "C" {

// Registers a bank under `key` (several registrations of one key may live at once: equal content,
// the key being its fingerprint; the latest is used). slot_of [n_experts]: bank slot or -1.
int jds_bank_register(int64_t key, int fmt, const uint8_t* data, const int64_t* stride, const int64_t* off, int D,
                      int F, int n_experts, int n_slots, const int32_t* slot_of) {
  auto b = std::make_shared<Bank>();
  b->fmt = fmt;
  b->data = data;
  std::memcpy(b->stride, stride, sizeof(b->stride));
  std::memcpy(b->off, off, sizeof(b->off));
  b->D = D;
  b->F = F;
  b->n_experts = n_experts;
  b->n_slots = n_slots;
  b->slot_of.assign(slot_of, slot_of + n_experts);
  std::lock_guard<std::mutex> guard(g_lock);
  g_banks[key].push_back(std::move(b));
  return 0;
}

// Drops the registration of `key` over `data` (its memory is about to be freed).
// Host functions of it still queued on a stream are waited for first.
void jds_bank_release(int64_t key, const uint8_t* data) {
  std::shared_ptr<Bank> gone;
  {
    std::lock_guard<std::mutex> guard(g_lock);
    auto it = g_banks.find(key);
    if (it == g_banks.end()) return;
    auto& v = it->second;
    for (size_t i = v.size(); i-- > 0;)
      if (v[i]->data == data) { gone = v[i]; v.erase(v.begin() + i); break; }
    if (v.empty()) g_banks.erase(it);
  }
  if (!gone) return;
  std::unique_lock<std::mutex> lock(gone->m);
  gone->idle.wait(lock, [&] { return gone->inflight == 0; });
}

// calls, nanoseconds inside the host part, distinct bank experts read (summed over calls); reset
// sets them to zero. -1 where no bank is registered under `key`.
int jds_bank_stats(int64_t key, int64_t* out, int reset) {
  auto b = find_bank(key);
  if (!b) return -1;
  out[0] = b->calls.load();
  out[1] = b->ns.load();
  out[2] = b->experts.load();
  if (reset) { b->calls = 0; b->ns = 0; b->experts = 0; }
  return 0;
}

}  // extern "C"
