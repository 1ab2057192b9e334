// cuda::PowerMonitor (kernels/cuda.h): a GPU's clocks, power and energy over an interval, from
// NVML, the driver's management library. It is opened at run time (libnvidia-ml.so.1 comes with
// the driver, not the toolkit), so kiln links nothing more and a machine without it only reports
// that it has none. The few entry points used are declared here with NVML's C signatures.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "kernels/cuda.h"

namespace kiln::cuda {
namespace {

struct NvmlDeviceSt;
using NvmlDevice = NvmlDeviceSt*;
using NvmlReturn = int;  // nvmlReturn_t: 0 is success

constexpr int kClockSm = 1;  // NVML_CLOCK_SM
// nvmlClocksThrottleReasons: software power cap, hardware power brake; software and hardware
// thermal slowdown.
constexpr unsigned long long kPowerReasons = 0x4ULL | 0x80ULL;
constexpr unsigned long long kThermalReasons = 0x20ULL | 0x40ULL;
constexpr auto kPeriod = std::chrono::milliseconds(20);

struct Nvml {
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*handle_by_pci)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*clock)(NvmlDevice, int, unsigned*) = nullptr;
  NvmlReturn (*max_clock)(NvmlDevice, int, unsigned*) = nullptr;
  NvmlReturn (*reasons)(NvmlDevice, unsigned long long*) = nullptr;
  NvmlReturn (*energy)(NvmlDevice, unsigned long long*) = nullptr;  // mJ since the driver loaded
  NvmlReturn (*power_limit)(NvmlDevice, unsigned*) = nullptr;       // mW
  std::string error;  // why NVML cannot be used; empty when it can
};

template <typename F>
bool find(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  return fn != nullptr;
}

Nvml open_nvml() {
  Nvml n;
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);  // open for the process's life
  if (lib == nullptr) {
    const char* e = dlerror();
    n.error = std::string("NVML (libnvidia-ml.so.1) cannot be opened: ") + (e ? e : "?");
    return n;
  }
  if (!find(lib, "nvmlInit_v2", n.init) ||
      !find(lib, "nvmlDeviceGetHandleByPciBusId_v2", n.handle_by_pci) ||
      !find(lib, "nvmlDeviceGetClockInfo", n.clock) ||
      !find(lib, "nvmlDeviceGetMaxClockInfo", n.max_clock) ||
      !find(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", n.reasons) ||
      !find(lib, "nvmlDeviceGetTotalEnergyConsumption", n.energy) ||
      !find(lib, "nvmlDeviceGetEnforcedPowerLimit", n.power_limit)) {
    n.error = "NVML (libnvidia-ml.so.1) lacks the clock, power or energy queries";
    return n;
  }
  if (const NvmlReturn r = n.init(); r != 0) {
    n.error = "nvmlInit failed (NVML error " + std::to_string(r) + ")";
  }
  return n;
}

const Nvml& nvml() {
  static const Nvml n = open_nvml();
  return n;
}

}  // namespace

struct PowerMonitor::Impl {
  NvmlDevice device = nullptr;
  std::chrono::steady_clock::time_point start;
  unsigned long long energy_start = 0;  // mJ
  std::atomic<bool> stopping{false};
  // Written by the sampling thread alone; stop() reads them after joining it.
  double clock_sum = 0;
  int samples = 0, power_capped = 0, thermal_capped = 0;
  std::thread sampler;

  void sample() {
    const Nvml& n = nvml();
    unsigned mhz = 0;
    unsigned long long why = 0;
    if (n.clock(device, kClockSm, &mhz) != 0 || n.reasons(device, &why) != 0) return;
    clock_sum += mhz;
    ++samples;
    power_capped += (why & kPowerReasons) != 0;
    thermal_capped += (why & kThermalReasons) != 0;
  }
};

PowerMonitor::PowerMonitor(int device) {
  if (!is_available()) {
    reason_ = cuda::unavailable_reason();  // not the member of the same name
    return;
  }
  if (device < 0) device = current_device();
  if (device >= device_count()) {
    reason_ = "cuda:" + std::to_string(device) + " does not exist";
    return;
  }
  const Nvml& n = nvml();
  if (!n.error.empty()) {
    reason_ = n.error;
    return;
  }
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) {
    (void)cudaGetLastError();
    reason_ = "the PCI bus id of cuda:" + std::to_string(device) + " is unknown";
    return;
  }
  auto impl = std::make_unique<Impl>();
  if (n.handle_by_pci(bus, &impl->device) != 0) {
    reason_ = std::string("NVML has no device at PCI bus ") + bus;
    return;
  }
  if (n.energy(impl->device, &impl->energy_start) != 0) {
    reason_ = "NVML reads no energy counter on this GPU";
    return;
  }
  impl->start = std::chrono::steady_clock::now();
  Impl* self = impl.get();
  impl->sampler = std::thread([self] {
    while (!self->stopping.load()) {
      self->sample();
      std::this_thread::sleep_for(kPeriod);
    }
  });
  impl_ = std::move(impl);
}

PowerMonitor::~PowerMonitor() {
  if (impl_ && impl_->sampler.joinable()) {
    impl_->stopping.store(true);
    impl_->sampler.join();
  }
}

PowerReport PowerMonitor::stop() {
  if (report_) return *report_;
  PowerReport r;
  if (impl_) {
    impl_->stopping.store(true);
    impl_->sampler.join();
    impl_->sample();  // the interval's end
    const Nvml& n = nvml();
    r.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->start).count();
    unsigned long long energy_end = impl_->energy_start;
    (void)n.energy(impl_->device, &energy_end);
    r.energy_joules = static_cast<double>(energy_end - impl_->energy_start) / 1e3;
    r.mean_power_watts = r.seconds > 0 ? r.energy_joules / r.seconds : 0;
    unsigned milliwatts = 0, mhz = 0;
    if (n.power_limit(impl_->device, &milliwatts) == 0) r.power_limit_watts = milliwatts / 1e3;
    if (n.max_clock(impl_->device, kClockSm, &mhz) == 0) r.max_sm_clock_mhz = mhz;
    r.samples = impl_->samples;
    if (r.samples > 0) {
      r.mean_sm_clock_mhz = impl_->clock_sum / r.samples;
      r.power_capped = static_cast<double>(impl_->power_capped) / r.samples;
      r.thermal_capped = static_cast<double>(impl_->thermal_capped) / r.samples;
    }
  }
  report_ = r;
  return r;
}

}  // namespace kiln::cuda
