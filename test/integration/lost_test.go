package integration

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// Issue 38: a reservation pod deleted under a live share (kubectl drain
// --force, an admin) used to leave its group joinable, and the next share
// had the scheduler make the pod again by the group's name, which the
// device plugin may give another GPU: that share booked on one GPU and run
// on another. Now the lost group is never joined nor its pod made again,
// the next share opens a group of its own, and the audit names the share
// whose GPU its group no longer holds (its node agent stops it: no pod of
// its group holds its GPU, TestSharesAreHeldOnlyByTheirOwnGroupsPod).
func TestLostReservationIsNeverMadeAgain(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "lost")
	gpuNode(t, "lost-0", "lost", 2, 81920, true)
	cleanUp(t, ns, "lost-0")
	tenant := tenantUser(t, ns, "lost-user")
	ctx := context.Background()

	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "first", testScheduler, "lost", fraction("0.25")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	first := api.DecisionGroups(placed(t, ns, "first").Annotations)
	if len(first) != 1 {
		t.Fatalf("first share's groups %v, want one", first)
	}
	lost := scheduler.ReservationName("lost-0", first[0])
	if err := shared.admin.CoreV1().Pods(reservationNS).Delete(ctx, lost, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	gone := func(context.Context) (bool, error) {
		_, err := shared.admin.CoreV1().Pods(reservationNS).Get(ctx, lost, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, gone); err != nil {
		t.Fatalf("reservation pod %s not deleted: %v", lost, err)
	}

	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "second", testScheduler, "lost", fraction("0.25")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	second := api.DecisionGroups(placed(t, ns, "second").Annotations)
	if len(second) != 1 || second[0] == first[0] {
		t.Errorf("second share's groups %v: it joined the group %s whose reservation pod is gone", second, first[0])
	}
	if ok, _ := gone(ctx); !ok {
		t.Errorf("reservation pod %s was made again by its name", lost)
	}
	out, _ := exec.Command(gpufracBinary(t), "audit", "--kubeconfig", e.adminKubeconfig, "--orphan-grace", "0s", "--node-selector", "scenario=lost").CombinedOutput()
	if !strings.Contains(string(out), "lost/first") || strings.Contains(string(out), "lost/second") {
		t.Errorf("audit does not name the share that lost its reservation pod, or names the new one:\n%s", out)
	}
}
