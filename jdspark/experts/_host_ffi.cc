// The host experts of one hybrid MoE layer as an XLA FFI custom call ("jds_host_experts").
//
// Inputs x [..., D] (bf16 or f32), ids [..., K] int32, weights [..., K] f32 -> y [..., D] f32: the
// sum over k of the experts that live in the registered bank (jds_moe_forward of _kernel.cc, which
// is compiled into the same library), each distinct bank expert read once. Attributes: bank (the
// key a bank was registered under), limit, round_bf16, threads, tile_f, tile_d, prefetch.
//
// The plan (pairs sorted by bank slot, stable, as cpu_gemv.Plan sorts them) is built here, so no
// Python runs in the round trip.
//   - CPU: the handler computes y in place.
//   - CUDA: the handler only enqueues on the call's stream: x, ids and weights copied to pinned
//     staging, a host function (cuLaunchHostFunc) that runs the plan and the GEMV on the CUDA
//     driver's callback thread, and y copied back. The thread that runs the executable does not
//     wait: it goes on launching the rest of the step (and the next step) while the GPU waits for
//     the host function in stream order. The driver API is found with dlsym (no CUDA headers or
//     libraries at build time). Staging is per (bank, rows, K, x dtype), reused in stream order.
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

extern "C" int jds_moe_forward(int fmt, const uint8_t* data, int64_t expert_nbytes, const int64_t* off,
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
  int64_t expert_nbytes;
  int64_t off[6];
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
    rc = jds_moe_forward(b.fmt, b.data, b.expert_nbytes, b.off, D, b.F, R, K, xf, int(s.uniq.size()), s.uniq.data(),
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

// ---- CPU -------------------------------------------------------------------------------------

ffi::Error HostExpertsCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
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

// ---- CUDA (driver API through dlsym) ------------------------------------------------------------

using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;

struct Driver {
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*launch_host_func)(CUstream, void (*)(void*), void*) = nullptr;
  CUresult (*host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*stream_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
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
    d.ok = d.memcpy_dtoh && d.memcpy_htod && d.launch_host_func && d.host_alloc && d.stream_ctx && d.ctx_push &&
           d.ctx_pop;
    return d;
  }();
  return d;
}

struct Staging {  // pinned buffers and scratch of one (bank, rows, K, x dtype); written in stream order only
  std::shared_ptr<Bank> bank;
  Shape shape;
  Launch launch;
  void* x = nullptr;
  int32_t* ids = nullptr;
  float* w = nullptr;
  float* y = nullptr;
  size_t x_bytes = 0, y_bytes = 0;
  Work work;
};

std::map<std::tuple<const Bank*, int, int, bool>, std::unique_ptr<Staging>> g_staging;

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

ffi::Error staging_for(const Driver& d, CUstream stream, std::shared_ptr<Bank> bank, const Shape& shape,
                       const Launch& a, Staging*& out) {
  std::lock_guard<std::mutex> guard(g_lock);
  auto& slot = g_staging[{bank.get(), shape.rows, shape.k, shape.x_bf16}];
  if (!slot) {
    auto st = std::make_unique<Staging>();
    st->bank = bank;
    st->shape = shape;
    st->launch = a;
    st->x_bytes = size_t(shape.rows) * bank->D * (shape.x_bf16 ? 2 : 4);
    st->y_bytes = size_t(shape.rows) * bank->D * 4;
    const size_t pair_bytes = size_t(shape.rows) * shape.k * 4;
    CUcontext ctx = nullptr;
    if (CUresult rc = d.stream_ctx(stream, &ctx)) return ffi::Error::Internal(cu_error("cuStreamGetCtx", rc));
    if (CUresult rc = d.ctx_push(ctx)) return ffi::Error::Internal(cu_error("cuCtxPushCurrent", rc));
    void* mem = nullptr;
    const CUresult rc = d.host_alloc(&mem, st->x_bytes + st->y_bytes + 2 * pair_bytes + 256, 0);
    CUcontext popped;
    d.ctx_pop(&popped);
    if (rc) return ffi::Error::Internal(cu_error("cuMemHostAlloc", rc));
    auto* base = static_cast<char*>(mem);
    auto align = [](size_t n) { return (n + 63) / 64 * 64; };
    st->x = base;
    st->y = reinterpret_cast<float*>(base + align(st->x_bytes));
    st->ids = reinterpret_cast<int32_t*>(base + align(st->x_bytes) + align(st->y_bytes));
    st->w = reinterpret_cast<float*>(base + align(st->x_bytes) + align(st->y_bytes) + align(pair_bytes));
    slot = std::move(st);
  }
  slot->launch = a;  // attributes are the executable's: equal for every call of one (bank, shape)
  out = slot.get();
  return ffi::Error::Success();
}

ffi::Error HostExpertsCuda(CUstream stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t key, float limit, int32_t round_bf16,
                           int32_t threads, int32_t tile_f, int32_t tile_d, int32_t prefetch) {
  const Driver& d = driver();
  if (!d.ok) return ffi::Error::Internal("jds_host_experts: the CUDA driver API (libcuda.so.1) was not found");
  auto bank = find_bank(key);
  Shape shape;
  if (auto err = check(bank.get(), key, x, ids, shape); err.failure()) return err;
  Staging* st = nullptr;
  const Launch a{limit, round_bf16, threads, tile_f, tile_d, prefetch};
  if (auto err = staging_for(d, stream, bank, shape, a, st); err.failure()) return err;
  const size_t pair_bytes = size_t(shape.rows) * shape.k * 4;
  CUresult rc = d.memcpy_dtoh(st->x, CUdeviceptr(x.untyped_data()), st->x_bytes, stream);
  if (!rc) rc = d.memcpy_dtoh(st->ids, CUdeviceptr(ids.untyped_data()), pair_bytes, stream);
  if (!rc) rc = d.memcpy_dtoh(st->w, CUdeviceptr(w.untyped_data()), pair_bytes, stream);
  if (!rc) {
    { std::lock_guard<std::mutex> guard(bank->m); ++bank->inflight; }
    rc = d.launch_host_func(stream, run_staged, st);
    if (rc) { std::lock_guard<std::mutex> guard(bank->m); --bank->inflight; }
  }
  if (!rc) rc = d.memcpy_htod(CUdeviceptr(y->untyped_data()), st->y, st->y_bytes, stream);
  if (rc) return ffi::Error::Internal(cu_error("enqueueing the host experts", rc));
  return ffi::Error::Success();
}

}  // namespace

#define JDS_BIND(...)                                                                                          \
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_cpu, HostExpertsCpu, JDS_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jds_host_experts_cuda, HostExpertsCuda, JDS_BIND(.Ctx<ffi::PlatformStream<void*>>()));

extern "C" {

// Registers a bank under `key` (several registrations of one key may live at once: equal content,
// the key being its fingerprint; the latest is used). slot_of [n_experts]: bank slot or -1.
int jds_bank_register(int64_t key, int fmt, const uint8_t* data, int64_t expert_nbytes, const int64_t* off, int D,
                      int F, int n_experts, int n_slots, const int32_t* slot_of) {
  auto b = std::make_shared<Bank>();
  b->fmt = fmt;
  b->data = data;
  b->expert_nbytes = expert_nbytes;
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
