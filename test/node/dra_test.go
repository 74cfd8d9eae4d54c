//go:build nodee2e

package node

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func (n *node) claimSpec(uid types.UID) string {
	return filepath.Join(n.cdiDir(), "gpu.gpufrac.io-"+string(uid)+".json")
}

// Claims of gpufrac's DRA driver run through the real kubelet's DRA
// manager: the kubelet calls the node agent's kubelet plugin (registered
// in its plugin registry, over the DRA gRPC API), containerd applies the
// CDI spec the plugin wrote, and runc runs the spec's createRuntime hook.
// The container sees what an annotated container with the same share
// sees, and the driver holds soft = request, hard = the claim's limit on
// its real cgroup; an sm-sharing share gets its MPS namespace with its
// compute ceiling. A restarted agent keeps both prepared shares (the MPS
// reconcile leaves a prepared claim's namespace alone), and deleting the
// pods unprepares them: spec and namespace gone.
func TestDRAClaimsRunWithTheirShares(t *testing.T) {
	shareClaim(t, "ts-share", api.DRADriver, "4Gi", "", "8Gi")
	claimPod(t, "dra-ts", "ts-share")
	shareClaim(t, "sm-share", "sm-sharing."+api.DRADriver, "2Gi", "25", "2Gi")
	claimPod(t, "dra-sm", "sm-share")

	ts := running(t, "dra-ts")
	a, tsUID := claimShare(t, "ts-share")
	if a.RequestMiB != 4096 || a.LimitMiB != 8192 || a.Mode != api.TimeSlicing || len(a.Devices) != 1 {
		t.Fatalf("time-slicing share %+v, want one GPU, 4096Mi, limit 8192Mi", a)
	}
	r := theNode.probeReport(t, ts, "main")
	checkInjected(t, r, a)
	checkLimits(t, ts, a, r)

	sm := running(t, "dra-sm")
	b, smUID := claimShare(t, "sm-share")
	if b.RequestMiB != 2048 || b.LimitMiB != 2048 || b.Mode != api.SMSharing || b.ActiveThreadPercentage() != 25 {
		t.Fatalf("sm-sharing share %+v, want 2048Mi, limit 2048Mi, 25%% of the SMs", b)
	}
	if b.Devices[0] == a.Devices[0] {
		t.Errorf("the sm-sharing share is on GPU %s, which the time-slicing one holds", b.Devices[0])
	}
	rs := theNode.probeReport(t, sm, "main")
	if got := rs.Env[nodeapi.EnvMPSThreads]; got != "25" {
		t.Errorf("the sm-sharing container sees %s=%q, want 25", nodeapi.EnvMPSThreads, got)
	}
	if got, want := rs.Env[nodeapi.EnvVisibleDevices], b.Devices[0]; got != want {
		t.Errorf("the sm-sharing container sees %s=%q, want %q", nodeapi.EnvVisibleDevices, got, want)
	}
	checkLimits(t, sm, b, rs)
	namespace := nodeapi.NamespaceName(string(smUID), "gpu")
	if got := mpstest.Ceiling(t, theNode.mpsRoot(), namespace); got != 25 {
		t.Errorf("MPS namespace %s has ceiling %d, want 25", namespace, got)
	}
	for _, uid := range []types.UID{tsUID, smUID} {
		if _, err := os.Stat(theNode.claimSpec(uid)); err != nil {
			t.Errorf("prepared claim %s has no CDI spec: %v", uid, err)
		}
	}

	// A restarted agent reconciles: the prepared shares stay, and so do
	// the containers.
	theNode.stopProcess("node-agent")
	if err := theNode.startAgent(); err != nil {
		t.Fatal(err)
	}
	if err := theNode.waitFractionReady(time.Minute); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second) // two resyncs, each with an MPS reconcile
	if got := mpstest.Ceiling(t, theNode.mpsRoot(), namespace); got != 25 {
		t.Errorf("after the agent's restart, MPS namespace %s has ceiling %d, want 25", namespace, got)
	}
	for _, p := range []*corev1.Pod{ts, sm} {
		after := getPod(t, p.Name)
		if after.UID != p.UID || after.Status.Phase != corev1.PodRunning || containerID(t, after, "main") != containerID(t, p, "main") {
			t.Errorf("pod %s did not survive the agent's restart: phase %s", p.Name, after.Status.Phase)
		}
	}

	// Deleting the pods unprepares their claims, through the new agent.
	deletePod(t, "dra-ts")
	deletePod(t, "dra-sm")
	for _, uid := range []types.UID{tsUID, smUID} {
		if err := waitFor("claim "+string(uid)+" unprepared", time.Minute, func() (bool, error) {
			_, err := os.Stat(theNode.claimSpec(uid))
			return os.IsNotExist(err), nil
		}); err != nil {
			t.Error(err)
		}
	}
	if got := mpstest.Ceiling(t, theNode.mpsRoot(), namespace); got != -1 {
		t.Errorf("MPS namespace %s is still there (ceiling %d) after its claim was unprepared", namespace, got)
	}
}
