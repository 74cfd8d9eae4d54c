/*
 * probe: the CUDA side of hack/gpu-proof.sh, with no CUDA toolkit. It loads
 * the driver API from libcuda.so.1 with dlopen, so it builds with any C
 * compiler and runs on any machine with an NVIDIA driver (or, in the tests,
 * the stand-in in fakecuda.c).
 *
 *   probe info          one line per device: index, UUID, name, total MiB
 *   probe alloc MIB [HOLD_MS]
 *                       allocate MIB MiB on device 0 in one piece, and hold
 *                       it HOLD_MS milliseconds (the script asks the MPS
 *                       daemon meanwhile whether this process is its client)
 *   probe spin MS       run one block that spins for MS milliseconds (by
 *                       its SM's clock, which runs on while another
 *                       context has the GPU: it cannot show time-slicing)
 *   probe work ITERS    run one thread through ITERS dependent FMAs: a fixed
 *                       amount of work, which takes twice as long when the
 *                       GPU is time-sliced with another context
 *
 * Exit status: 0 done, 1 usage, 2 no driver (libcuda or a symbol missing),
 * 3 the operation failed (a CUDA error, named on stderr).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

static CUresult (*cuInit)(unsigned int);
static CUresult (*cuDeviceGetCount)(int *);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
static CUresult (*cuDeviceGetUuid)(unsigned char *, CUdevice);
static CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*cuCtxCreate)(CUcontext *, unsigned int, CUdevice);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree)(CUdeviceptr);
static CUresult (*cuModuleLoadData)(CUmodule *, const void *);
static CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, void *, void **, void **);
static CUresult (*cuGetErrorName)(CUresult, const char **);

/* spin: a kernel that spins until its clock has advanced by the given
 * cycles; work: one that runs a fixed chain of dependent FMAs and stores
 * the result (so that it cannot be optimised away). */
static const char spin_ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry spin(.param .u64 cycles)\n"
    "{\n"
    "  .reg .u64 %rd<5>;\n"
    "  .reg .pred %p;\n"
    "  ld.param.u64 %rd1, [cycles];\n"
    "  mov.u64 %rd2, %clock64;\n"
    "LOOP:\n"
    "  mov.u64 %rd3, %clock64;\n"
    "  sub.u64 %rd4, %rd3, %rd2;\n"
    "  setp.lt.u64 %p, %rd4, %rd1;\n"
    "  @%p bra LOOP;\n"
    "  ret;\n"
    "}\n"
    ".visible .entry work(.param .u64 iters, .param .u64 out)\n"
    "{\n"
    "  .reg .u64 %rd<4>;\n"
    "  .reg .f32 %f<4>;\n"
    "  .reg .pred %p;\n"
    "  ld.param.u64 %rd1, [iters];\n"
    "  ld.param.u64 %rd3, [out];\n"
    "  mov.f32 %f1, 0f3F800000;\n"
    "  mov.f32 %f2, 0f3F7FFFFF;\n"
    "  mov.f32 %f3, 0f33800000;\n"
    "  mov.u64 %rd2, 0;\n"
    "WORK:\n"
    "  fma.rn.f32 %f1, %f1, %f2, %f3;\n"
    "  add.u64 %rd2, %rd2, 1;\n"
    "  setp.lt.u64 %p, %rd2, %rd1;\n"
    "  @%p bra WORK;\n"
    "  st.global.f32 [%rd3], %f1;\n"
    "  ret;\n"
    "}\n";

static void *lib;

static void *sym(const char *name) {
  void *p = dlsym(lib, name);
  if (p == NULL) {
    fprintf(stderr, "probe: libcuda.so.1 has no %s: %s\n", name, dlerror());
    exit(2);
  }
  return p;
}

static const char *errname(CUresult r) {
  const char *s = NULL;
  if (cuGetErrorName == NULL || cuGetErrorName(r, &s) != 0 || s == NULL) return "CUDA_ERROR_UNKNOWN";
  return s;
}

#define CHECK(call)                                                          \
  do {                                                                       \
    CUresult r_ = (call);                                                    \
    if (r_ != 0) {                                                           \
      fprintf(stderr, "probe: %s: %s (%d)\n", #call, errname(r_), r_);       \
      return 3;                                                              \
    }                                                                        \
  } while (0)

static void load(void) {
  lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "probe: cannot load libcuda.so.1 (no NVIDIA driver here?): %s\n", dlerror());
    exit(2);
  }
  *(void **)&cuGetErrorName = sym("cuGetErrorName");
  *(void **)&cuInit = sym("cuInit");
  *(void **)&cuDeviceGetCount = sym("cuDeviceGetCount");
  *(void **)&cuDeviceGet = sym("cuDeviceGet");
  *(void **)&cuDeviceGetName = sym("cuDeviceGetName");
  *(void **)&cuDeviceTotalMem = sym("cuDeviceTotalMem_v2");
  *(void **)&cuDeviceGetUuid = sym("cuDeviceGetUuid_v2");
  *(void **)&cuDeviceGetAttribute = sym("cuDeviceGetAttribute");
  *(void **)&cuCtxCreate = sym("cuCtxCreate_v2");
  *(void **)&cuCtxSynchronize = sym("cuCtxSynchronize");
  *(void **)&cuMemAlloc = sym("cuMemAlloc_v2");
  *(void **)&cuMemFree = sym("cuMemFree_v2");
  *(void **)&cuModuleLoadData = sym("cuModuleLoadData");
  *(void **)&cuModuleGetFunction = sym("cuModuleGetFunction");
  *(void **)&cuLaunchKernel = sym("cuLaunchKernel");
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int info(void) {
  int n = 0;
  CHECK(cuDeviceGetCount(&n));
  for (int i = 0; i < n; i++) {
    CUdevice d;
    char name[256] = {0};
    size_t total = 0;
    unsigned char u[16];
    CHECK(cuDeviceGet(&d, i));
    CHECK(cuDeviceGetName(name, sizeof name - 1, d));
    CHECK(cuDeviceTotalMem(&total, d));
    CHECK(cuDeviceGetUuid(u, d));
    printf("device %d GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x %zu MiB %s\n", i,
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15],
           total >> 20, name);
  }
  return 0;
}

static int context(CUdevice *d) {
  CUcontext ctx;
  CHECK(cuDeviceGet(d, 0));
  CHECK(cuCtxCreate(&ctx, 0, *d));
  return 0;
}

static int alloc(long mib, long hold_ms) {
  CUdevice d;
  CUdeviceptr p;
  int rc = context(&d);
  if (rc != 0) return rc;
  CUresult r = cuMemAlloc(&p, (size_t)mib << 20);
  if (r != 0) {
    printf("alloc %ld MiB: failed: %s\n", mib, errname(r));
    return 3;
  }
  printf("alloc %ld MiB: ok\n", mib);
  if (hold_ms > 0) {
    printf("holding %ld ms as pid %d\n", hold_ms, (int)getpid());
    fflush(stdout);
    struct timespec ts = {(time_t)(hold_ms / 1000), (hold_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  CHECK(cuMemFree(p));
  return 0;
}

static int spin(long ms) {
  CUdevice d;
  CUmodule m;
  CUfunction f;
  int khz = 0;
  int rc = context(&d);
  if (rc != 0) return rc;
  CHECK(cuDeviceGetAttribute(&khz, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, d));
  CHECK(cuModuleLoadData(&m, spin_ptx));
  CHECK(cuModuleGetFunction(&f, m, "spin"));
  unsigned long long cycles = (unsigned long long)khz * (unsigned long long)ms;
  void *args[] = {&cycles};
  double start = now();
  CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
  CHECK(cuCtxSynchronize());
  double end = now();
  printf("spin %ld ms: start %.6f end %.6f took %.0f ms\n", ms, start, end, (end - start) * 1000);
  return 0;
}

static int work(long iters) {
  CUdevice d;
  CUmodule m;
  CUfunction f;
  CUdeviceptr out;
  int rc = context(&d);
  if (rc != 0) return rc;
  CHECK(cuModuleLoadData(&m, spin_ptx));
  CHECK(cuModuleGetFunction(&f, m, "work"));
  CHECK(cuMemAlloc(&out, sizeof(float)));
  unsigned long long n = (unsigned long long)iters;
  void *args[] = {&n, &out};
  double start = now();
  CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
  CHECK(cuCtxSynchronize());
  double end = now();
  printf("work %ld iters: start %.6f end %.6f took %.0f ms\n", iters, start, end, (end - start) * 1000);
  CHECK(cuMemFree(out));
  return 0;
}

static const char usage[] = "usage: probe info | probe alloc MIB [HOLD_MS] | probe spin MS | probe work ITERS\n";

/* number reads a positive whole number, or says why not. */
static int number(const char *what, const char *arg, long *n) {
  char *end = NULL;
  *n = strtol(arg, &end, 10);
  if (end == arg || *end != '\0' || *n <= 0) {
    fprintf(stderr, "probe: %s %s: want a positive whole number\n", what, arg);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  long n = 0, hold = 0;
  int is_info = argc == 2 && strcmp(argv[1], "info") == 0;
  int is_alloc = (argc == 3 || argc == 4) && strcmp(argv[1], "alloc") == 0;
  int is_spin = argc == 3 && strcmp(argv[1], "spin") == 0;
  int is_work = argc == 3 && strcmp(argv[1], "work") == 0;
  if (!is_info && !is_alloc && !is_spin && !is_work) {
    fputs(usage, stderr);
    return 1;
  }
  if (argc >= 3 && number(argv[1], argv[2], &n) != 0) return 1;
  if (argc == 4 && number("hold", argv[3], &hold) != 0) return 1;
  load();
  CHECK(cuInit(0));
  if (is_info) return info();
  if (is_alloc) return alloc(n, hold);
  if (is_work) return work(n);
  return spin(n);
}
