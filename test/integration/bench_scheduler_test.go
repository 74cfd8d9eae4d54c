package integration

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/api"
)

// BenchmarkSchedulerThroughput runs the real scheduler binary against the
// real API server with 1,000 and 5,000 nodes of 8 GPUs and measures how fast it
// places 2,000 whole-GPU pods (the baseline: the default plugins plus our
// Filter and Score) and 2,000 fractional pods (parse, ledger, policy,
// reservation pods, decision write-back), in the same run. Each batch is
// created first, then a fresh scheduler places it, so that pod creation
// (and the webhooks it calls) does not compete for the CPU: throughput is
// measured between the first and the last bind the scheduler logged.
// The fractional batch runs twice: cold (every shared GPU's reservation
// pod is made) and warm (the same pods again after the first are deleted:
// they join the idle reservation pods the first left, kept for shares).
// Reported: pods/s of each, the ratios to whole-GPU pods, the scheduler's
// CPU per pod and the rest's, and the reservation pods each batch left.
// Run with -benchtime 1x.
func BenchmarkSchedulerThroughput(b *testing.B) {
	for _, nodes := range []int{1000, 5000} {
		b.Run(fmt.Sprintf("nodes=%d", nodes), func(b *testing.B) { benchmarkThroughput(b, nodes) })
	}
}

func benchmarkThroughput(b *testing.B, nodes int) {
	const gpus, pods = 8, 2000
	e := schedulerEnv(b)
	names := make([]string, nodes)
	parallel(nodes, func(i int) {
		names[i] = fmt.Sprintf("bench-%05d", i)
		if err := makeGPUNode(names[i], "bench", gpus, 81920, true); err != nil {
			b.Error(err)
		}
	})
	b.Cleanup(func() {
		parallel(nodes, func(i int) {
			_ = shared.admin.CoreV1().Nodes().Delete(context.Background(), names[i], metav1.DeleteOptions{})
		})
	})
	if b.Failed() {
		b.FailNow()
	}
	fractions := []string{"0.1", "0.25", "0.5", "0.3", "0.75", "0.2"}
	for i := 0; b.Loop(); i++ {
		batch := func(kind string, keep bool, pod func(ns string, j int) *corev1.Pod) (podsPerSecond float64) {
			ns := namespace(b, fmt.Sprintf("bench-%s-%d-%d", kind, i, time.Now().UnixNano()))
			parallel(pods, func(j int) {
				if _, err := shared.alice.CoreV1().Pods(ns).Create(context.Background(), pod(ns, j), metav1.CreateOptions{}); err != nil {
					b.Error(err)
				}
			})
			others, self := controlPlaneCPU(), cpuSeconds(os.Getpid())
			proc := e.startScheduler(b, "gpufrac-bench", nil)
			// Watch the scheduler's log rather than list 2,000 pods over
			// and over: the API server's CPU is what is being measured.
			if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 10*time.Minute, true, func(context.Context) (bool, error) {
				return binds(proc.log, ns) >= pods, nil
			}); err != nil {
				b.Fatalf("%d of %d pods bound in %s", binds(proc.log, ns), pods, ns)
			}
			first, last := bindSpan(b, proc.log, ns)
			// Where the CPU went: the scheduler, and the rest of this
			// machine's cluster (API server, etcd, and this process:
			// webhook server and device-plugin stand-in).
			b.ReportMetric(cpuSeconds(proc.cmd.Process.Pid)*1000/pods, kind+"-sched-cpu-ms/pod")
			b.ReportMetric((controlPlaneCPU()-others)*1000/pods, kind+"-rest-cpu-ms/pod")
			b.ReportMetric((cpuSeconds(os.Getpid())-self)*1000/pods, kind+"-webhook+plugin-cpu-ms/pod")
			proc.stop()
			if raw, err := os.ReadFile(proc.log); err == nil {
				b.ReportMetric(float64(strings.Count(string(raw), "Unable to schedule pod")), kind+"-retries")
			}
			waitAllBound(b, ns, pods)
			// Reservation pods, one per shared GPU: the writes a fraction
			// costs beyond its Binding (a create and the UUID annotation).
			if held, err := shared.admin.CoreV1().Pods(reservationNS).List(context.Background(), metav1.ListOptions{ResourceVersion: "0"}); err == nil {
				b.ReportMetric(float64(len(held.Items)), kind+"-reservations")
			}
			now := metav1.DeleteOptions{GracePeriodSeconds: new(int64)}
			if err := shared.admin.CoreV1().Pods(ns).DeleteCollection(context.Background(), now, metav1.ListOptions{}); err != nil {
				b.Fatal(err)
			}
			waitAllBound(b, ns, 0)
			if !keep {
				if err := shared.admin.CoreV1().Pods(reservationNS).DeleteCollection(context.Background(), now, metav1.ListOptions{}); err != nil {
					b.Fatal(err)
				}
				waitReservations(b, 0, names...)
			}
			return float64(pods-1) / last.Sub(first).Seconds()
		}
		whole := batch("whole", false, func(ns string, j int) *corev1.Pod {
			return wholeGPUPod(ns, fmt.Sprintf("w-%d", j), "gpufrac-bench", "bench", 1)
		})
		fractional := func(ns string, j int) *corev1.Pod {
			return workload(ns, fmt.Sprintf("f-%d", j), "gpufrac-bench", "bench", fraction(fractions[j%len(fractions)]))
		}
		// Cold: every shared GPU needs its reservation pod made. Warm: the
		// same pods again once the first ones are gone, as in a cluster
		// whose fractions come and go: the idle reservation pods the
		// first batch left are kept, and the shares join them.
		frac := batch("frac", true, fractional)
		warm := batch("warm", false, fractional)
		b.ReportMetric(whole, "whole-pods/s")
		b.ReportMetric(frac, "frac-pods/s")
		b.ReportMetric(warm, "warm-pods/s")
		b.ReportMetric(frac/whole, "ratio")
		b.ReportMetric(warm/whole, "warm-ratio")
	}
}

// parallel runs f(0..n-1) on 16 goroutines.
func parallel(n int, f func(int)) { localcluster.Parallel(n, 16, f) }

// waitAllBound waits until the namespace holds exactly n pods, all bound
// (n = 0: until it is empty).
func waitAllBound(b testing.TB, ns string, n int) {
	b.Helper()
	got := -1
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 10*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := shared.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err != nil {
			return false, err
		}
		got = 0
		for _, p := range list.Items {
			if p.Spec.NodeName != "" && (api.WholeGPUs(&p.Spec) > 0 || p.Annotations[api.GPUGroupsAnnotation] != "") {
				got++
			}
		}
		return len(list.Items) == n && got == n, nil
	})
	if err != nil {
		b.Fatalf("namespace %s: %d pods bound, want %d", ns, got, n)
	}
}

// bindSpan reads the scheduler's log for its first and last successful
// bind of a pod in the namespace (klog's header carries microseconds).
func bindSpan(b testing.TB, log, ns string) (first, last time.Time) {
	b.Helper()
	f, err := os.Open(log)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	scan := bufio.NewScanner(f)
	scan.Buffer(make([]byte, 1<<20), 1<<20)
	for scan.Scan() {
		line := scan.Text()
		if !strings.Contains(line, "Successfully bound pod to node") || !strings.Contains(line, `pod="`+ns+"/") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 2 {
			continue
		}
		t, err := time.Parse("15:04:05.000000", fields[1])
		if err != nil {
			continue
		}
		if first.IsZero() {
			first = t
		}
		last = t
	}
	if first.IsZero() || !last.After(first) {
		b.Fatalf("no bind span for %s in the scheduler log", ns)
	}
	return first, last
}

// cpuSeconds is the CPU time (user + system) a process has used so far.
func cpuSeconds(pid int) float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses.
	fields := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+1:]))
	if len(fields) < 13 {
		return 0
	}
	var utime, stime float64
	_, _ = fmt.Sscan(fields[11], &utime)
	_, _ = fmt.Sscan(fields[12], &stime)
	return (utime + stime) / 100 // clock ticks; USER_HZ is 100 on Linux
}

// controlPlaneCPU is the CPU time used so far by kube-apiserver, etcd and
// this test process.
func controlPlaneCPU() float64 {
	total := cpuSeconds(os.Getpid())
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		comm, err := os.ReadFile("/proc/" + d.Name() + "/comm")
		if err != nil {
			continue
		}
		if name := strings.TrimSpace(string(comm)); name == "kube-apiserver" || name == "etcd" {
			var pid int
			if _, err := fmt.Sscan(d.Name(), &pid); err == nil {
				total += cpuSeconds(pid)
			}
		}
	}
	return total
}

// binds counts the scheduler's logged binds of pods in the namespace.
func binds(log, ns string) int {
	raw, err := os.ReadFile(log)
	if err != nil {
		return 0
	}
	return strings.Count(string(raw), `"Successfully bound pod to node" pod="`+ns+"/")
}
