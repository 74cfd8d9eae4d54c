/*
 * fakecuda: a stand-in libcuda.so.1 for probe's tests on machines without
 * a GPU. It implements only the driver API calls probe makes, with what a
 * test asks for through the environment:
 *
 *   FAKECUDA_INIT_ERROR  cuInit returns this code (100: no device)
 *   FAKECUDA_TOTAL_MIB   device memory (default 81920)
 *   FAKECUDA_FREE_MIB    largest allocation that succeeds (default: all);
 *                        larger ones return CUDA_ERROR_OUT_OF_MEMORY
 *
 * A "kernel" is a sleep of its first parameter in nanoseconds (spin's
 * cycles at a 1 GHz clock; work's iterations, one a nanosecond). It is not CUDA and
 * proves nothing about a GPU: it tests probe's own logic and output.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

static long env(const char *name, long otherwise) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : otherwise;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
  switch (r) {
  case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
  case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
  case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
  case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
  default: *s = "CUDA_ERROR_UNKNOWN"; break;
  }
  return 0;
}
CUresult cuInit(unsigned int flags) { (void)flags; return (CUresult)env("FAKECUDA_INIT_ERROR", 0); }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int i) { *d = i; return i == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d;
  strncpy(name, "Fake GPU (not CUDA)", (size_t)len);
  return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
  (void)d;
  *bytes = (size_t)env("FAKECUDA_TOTAL_MIB", 81920) << 20;
  return 0;
}
CUresult cuDeviceGetUuid_v2(unsigned char *u, CUdevice d) {
  for (int i = 0; i < 16; i++) u[i] = (unsigned char)(0x10 + i + d);
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  (void)d;
  *v = attr == CU_DEVICE_ATTRIBUTE_CLOCK_RATE ? 1000000 : 0; /* clock rate in kHz: 1 GHz */
  return 0;
}
CUresult cuCtxCreate_v2(CUcontext *c, unsigned int flags, CUdevice d) {
  (void)flags; (void)d;
  *c = (CUcontext)1;
  return 0;
}
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  long total = env("FAKECUDA_TOTAL_MIB", 81920);
  if ((long)(bytes >> 20) > env("FAKECUDA_FREE_MIB", total)) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = 0x1000;
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return 0; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  if (strstr((const char *)image, ".entry spin") == NULL) return CUDA_ERROR_INVALID_IMAGE;
  *m = (CUmodule)1;
  return 0;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  (void)m;
  if (strcmp(name, "spin") != 0 && strcmp(name, "work") != 0) return CUDA_ERROR_NOT_FOUND;
  *f = (CUfunction)1;
  return 0;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
  unsigned long long cycles = *(unsigned long long *)params[0];
  unsigned long long ns = cycles; /* 1 GHz: one cycle a nanosecond */
  struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
  nanosleep(&ts, NULL);
  return 0;
}
