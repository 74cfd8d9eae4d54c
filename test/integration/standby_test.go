package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// Two scheduler replicas under leader election, as the chart runs them:
// the standby writes nothing while the leader places shares and decides a
// resize and a refused reservation pod waits for the collector, and takes over, placing and resizing, once the leader
// is killed; the books stay clean. Each replica is its own identity (a
// group of its own, which the API server's audit log records) and its own
// host (a UTS namespace: kube-scheduler's identity is the hostname). The
// replicas run without delayCacheUntilActive, so the standby's informers
// and the plugin's collector do run: only the plugin's own reading of the
// Lease keeps the standby from writing.
func TestStandbySchedulerWritesNothing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test gives each scheduler replica a hostname of its own (unshare --uts): it needs root, as make test has")
	}
	e := schedulerEnv(t)
	const name, lease = "gpufrac-standby", "gpufrac-scheduler" // the Lease its RBAC names
	ns := namespace(t, "sched-standby")
	nodes := []string{"standby-0", "standby-1"}
	ctx := context.Background()
	for _, n := range nodes {
		gpuNode(t, n, "standby", 2, 81920, true)
		// The backend that can change a running container's limit: the
		// resizes below are granted, not refused.
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"driver"}}}`, api.LabelMemoryEnforcement)
		if _, err := shared.admin.CoreV1().Nodes().Patch(ctx, n, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cleanUp(t, ns, nodes...)

	replica := func(host string) *schedulerProcess {
		t.Helper()
		kc, err := testenv.KubeConfig(shared.env, schedulerUser, "system:serviceaccounts", "system:serviceaccounts:gpufrac-system", "system:authenticated",
			testenv.AuditedGroup, "replica:"+host)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(t.TempDir(), host+".kubeconfig")
		if err := os.WriteFile(path, kc, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg := e.schedulerConfig(t, name, path, map[string]any{"leaderLease": "gpufrac-system/" + lease})
		cfg["delayCacheUntilActive"] = false
		cfg["leaderElection"] = map[string]any{"leaderElect": true, "resourceNamespace": "gpufrac-system", "resourceName": lease,
			"leaseDuration": "10s", "renewDeadline": "8s", "retryPeriod": "1s"}
		return launchScheduler(t, host, cfg, "unshare", "--uts", "sh", "-c", `hostname "$0" && exec "$@"`, host)
	}
	holder := func(host string) {
		t.Helper()
		var seen string
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			l, err := shared.admin.CoordinationV1().Leases("gpufrac-system").Get(ctx, lease, metav1.GetOptions{})
			if err != nil || l.Spec.HolderIdentity == nil {
				return false, nil //nolint:nilerr // not elected yet
			}
			seen = *l.Spec.HolderIdentity
			return strings.HasPrefix(seen, host+"_"), nil
		})
		if err != nil {
			t.Fatalf("the Lease's holder is %q, want %s: %v", seen, host, err)
		}
	}
	writes := func(host string) []testenv.Write {
		t.Helper()
		all, err := testenv.Writes(shared.env)
		if err != nil {
			t.Fatal(err)
		}
		var mine []testenv.Write
		for _, w := range all {
			for _, g := range w.Groups {
				if g == "replica:"+host {
					mine = append(mine, w)
				}
			}
		}
		return mine
	}
	ask := func(pod, request string) {
		t.Helper()
		patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q,%q:%q}}}`, api.KeyResizeRequest, request, api.KeyResizeLimit, request)
		if _, err := shared.alice.CoreV1().Pods(ns).Patch(ctx, pod, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	resized := func(pod, request string) {
		t.Helper()
		key := api.ContainerKey("main", api.SuffixMemoryRequest)
		var got string
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			got = p.Annotations[key]
			return got == request, nil
		})
		if err != nil {
			t.Fatalf("pod %s: %s is %q, want the resize to %s decided", pod, key, got, request)
		}
	}

	leader := replica("replica-a")
	holder("replica-a")
	standby := replica("replica-b")
	for i := range 3 {
		create(t, workload(ns, fmt.Sprintf("half-%d", i), name, "standby", fraction("0.5")))
		placed(t, ns, fmt.Sprintf("half-%d", i))
	}
	// The leader stalls (a long pause, a starved CPU) for less than its
	// Lease's duration, while a resize waits and a reservation pod the
	// kubelet refused (Failed) waits to be collected: the standby, whose
	// cache sees both too, must leave them to the leader, which decides
	// the resize once it runs again.
	leader.signal(syscall.SIGSTOP)
	ask("half-0", "20480Mi")
	args, err := scheduler.DecodeArgs(nil)
	if err != nil {
		t.Fatal(err)
	}
	refused := scheduler.ReservationPod(args, nodes[1], "g-refused")
	if refused, err = shared.admin.CoreV1().Pods(refused.Namespace).Create(ctx, refused, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	failed := `{"status":{"phase":"Failed","reason":"UnexpectedAdmissionError"}}`
	if _, err := shared.admin.CoreV1().Pods(refused.Namespace).Patch(ctx, refused.Name, types.MergePatchType, []byte(failed), metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	stalled := writes("replica-b")
	leader.signal(syscall.SIGCONT)
	if len(stalled) != 0 {
		t.Fatalf("the standby replica wrote %d times while the leader stalled: %v", len(stalled), stalled)
	}
	resized("half-0", "20480Mi")
	t.Cleanup(func() {
		_ = shared.admin.CoreV1().Pods(refused.Namespace).Delete(context.Background(), refused.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	// A GPU's last tenant goes: the leader's books change, the standby's too.
	if err := shared.admin.CoreV1().Pods(ns).Delete(ctx, "half-2", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, ns, "half-2")
	e.audit(t, "standby")
	// The standby's collector ran and held back (it says so), and wrote
	// nothing; the leader did write (the count can see a write).
	waitLog(t, standby, "The collector waits: this replica does not lead")
	if w := writes("replica-b"); len(w) != 0 {
		t.Fatalf("the standby replica wrote %d times while the leader led: %v", len(w), w)
	}
	if w := writes("replica-a"); len(w) == 0 {
		t.Fatal("the audit log holds no write of the leader either: it cannot show the standby's")
	}

	leader.kill()
	holder("replica-b")
	for i := 3; i < 5; i++ {
		create(t, workload(ns, fmt.Sprintf("half-%d", i), name, "standby", fraction("0.5")))
		placed(t, ns, fmt.Sprintf("half-%d", i))
	}
	ask("half-1", "30720Mi")
	resized("half-1", "30720Mi")
	e.audit(t, "standby")
	if w := writes("replica-b"); len(w) == 0 {
		t.Fatal("the replica that took over wrote nothing: it did not place or resize")
	}
}

// waitLog waits until a scheduler's log has a line containing want.
func waitLog(t *testing.T, p *schedulerProcess, want string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		raw, err := os.ReadFile(p.log)
		return err == nil && strings.Contains(string(raw), want), nil
	})
	if err != nil {
		t.Fatalf("the scheduler's log never said %q", want)
	}
}
