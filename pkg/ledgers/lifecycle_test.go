package ledgers

import (
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Every state × event, standing or not, with every reading of a seen pod:
// the table of lifecycle.go, row by row.
func TestGroupLifecycleTable(t *testing.T) {
	var (
		pending  = Seen{}
		named    = Seen{Named: true}
		failed   = Seen{Failed: true, Named: true}
		deleting = Seen{Deleting: true, Named: true}
	)
	type row struct {
		from     GroupState
		event    GroupEvent
		seen     Seen
		standing bool
		to       GroupState
		fx       Effects
	}
	rows := []row{
		// Booking a standing pod before it exists.
		{GroupNone, EventBook, Seen{}, true, GroupBooked, Effects{Hold: true}},
		{GroupPending, EventBook, Seen{}, true, GroupPending, Effects{}},
		{GroupBooked, EventCreateFailed, Seen{}, true, GroupNone, Effects{Rebuild: true}},
		{GroupNamed, EventCreateFailed, Seen{}, true, GroupNamed, Effects{}},

		// First sight of a pod: its slot is held and the collector woken.
		{GroupNone, EventSeen, pending, false, GroupPending, Effects{Hold: true, Wake: true, Settle: true}},
		{GroupNone, EventSeen, named, false, GroupNamed, Effects{Hold: true, Wake: true, Settle: true}},
		{GroupNone, EventSeen, failed, false, GroupFailed, Effects{Hold: true, Wake: true, Settle: true}},
		{GroupNone, EventSeen, deleting, false, GroupRetiring, Effects{Hold: true, Wake: true, Settle: true}},

		// A booked standing pod shows up.
		{GroupBooked, EventSeen, pending, true, GroupPending, Effects{Settle: true}},
		{GroupBooked, EventSeen, named, true, GroupNamed, Effects{Settle: true, Wake: true}},
		{GroupBooked, EventSeen, named, false, GroupNamed, Effects{Settle: true}},

		// The node agent names the GPU: a standing one wakes the collector.
		{GroupPending, EventSeen, pending, true, GroupPending, Effects{Settle: true}},
		{GroupPending, EventSeen, named, true, GroupNamed, Effects{Settle: true, Wake: true}},
		{GroupPending, EventSeen, named, false, GroupNamed, Effects{Settle: true}},
		{GroupNamed, EventSeen, named, true, GroupNamed, Effects{Settle: true}},

		// Failure and deletion.
		{GroupPending, EventSeen, failed, false, GroupFailed, Effects{Settle: true}},
		{GroupNamed, EventSeen, failed, true, GroupFailed, Effects{Settle: true}},
		{GroupNamed, EventSeen, deleting, false, GroupRetiring, Effects{Settle: true}},
		{GroupFailed, EventSeen, named, false, GroupFailed, Effects{Settle: true}},
		{GroupFailed, EventSeen, deleting, false, GroupRetiring, Effects{Settle: true}},

		// Retiring sticks, whatever the pod shows.
		{GroupRetiring, EventSeen, named, false, GroupRetiring, Effects{Settle: true}},
		{GroupRetiring, EventSeen, pending, true, GroupRetiring, Effects{Settle: true}},
		{GroupBooked, EventRetire, Seen{}, true, GroupRetiring, Effects{}},
		{GroupPending, EventRetire, Seen{}, false, GroupRetiring, Effects{}},
		{GroupNamed, EventRetire, Seen{}, false, GroupRetiring, Effects{}},
		{GroupFailed, EventRetire, Seen{}, false, GroupRetiring, Effects{}},
		{GroupRetiring, EventRetire, Seen{}, false, GroupRetiring, Effects{}},
		{GroupNone, EventRetire, Seen{}, false, GroupNone, Effects{}},

		// Gone: the slot is freed; a standing group's node is booked again.
		{GroupNamed, EventDeleted, Seen{}, false, GroupNone, Effects{Free: true, Wake: true}},
		{GroupRetiring, EventDeleted, Seen{}, false, GroupNone, Effects{Free: true, Wake: true}},
		{GroupNamed, EventDeleted, Seen{}, true, GroupNone, Effects{Free: true, Wake: true, Rebuild: true}},
		{GroupFailed, EventDeleted, Seen{}, true, GroupNone, Effects{Free: true, Wake: true, Rebuild: true}},
	}
	for _, r := range rows {
		name := fmt.Sprintf("%s/%s/%+v/standing=%v", r.from, r.event, r.seen, r.standing)
		to, fx := Transition(r.from, r.event, r.seen, r.standing)
		if to != r.to || fx != r.fx {
			t.Errorf("%s: → %s %+v, want %s %+v", name, to, fx, r.to, r.fx)
		}
	}
}

// Only a booked or live pod's group takes shares, and a standing one only
// while its node asks for it.
func TestJoinable(t *testing.T) {
	for s := GroupNone; s <= GroupRetiring; s++ {
		for _, standing := range []bool{false, true} {
			for _, wanted := range []bool{false, true} {
				want := (s == GroupBooked || s == GroupPending || s == GroupNamed) && (!standing || wanted)
				if got := Joinable(s, standing, wanted); got != want {
					t.Errorf("Joinable(%s, standing %v, wanted %v) = %v, want %v", s, standing, wanted, got, want)
				}
			}
		}
	}
}

// Once a group is not joinable, no event makes it joinable again: its pod
// may be deleted once idle.
func TestRetiredAndFailedGroupsNeverTakeSharesAgain(t *testing.T) {
	seens := []Seen{{}, {Named: true}, {Failed: true}, {Deleting: true}}
	for _, start := range []GroupState{GroupFailed, GroupRetiring} {
		for _, e := range []GroupEvent{EventBook, EventCreateFailed, EventSeen, EventRetire} {
			for _, seen := range seens {
				if next, _ := Transition(start, e, seen, false); Joinable(next, false, true) {
					t.Errorf("%s --%s %+v--> %s: joinable again", start, e, seen, next)
				}
			}
		}
	}
}

// A pod made again under the name of a failed one starts afresh, and of
// two reservation pods naming one GPU, tenants join the one a share may
// still join.
func TestReservationPodsMadeAgain(t *testing.T) {
	n := NewNode("n1", api.Inventory{Count: 2, MemoryMiB: 81920, Model: "H100"})
	failed := reservationPod("ga", "uid-1", "GPU-a")
	failed.Status.Phase = corev1.PodFailed
	n.SeeReservation(failed)
	if n.Joinable("ga") {
		t.Fatalf("failed pod's group is joinable (%s)", n.Reservations["ga"].State)
	}
	n.SeeReservation(reservationPod("ga", "uid-2", "GPU-a"))
	if s := n.Reservations["ga"].State; s != GroupNamed || !n.Joinable("ga") {
		t.Errorf("a new pod of the same name: %s, want Named and joinable", s)
	}
	// ga retires (its pod is being deleted); gb, made since, names the same GPU.
	n.Event("ga", EventRetire, Seen{})
	n.SeeReservation(reservationPod("gb", "uid-3", "GPU-a"))
	if g, ok := n.GroupOf("GPU-a"); !ok || g != "gb" {
		t.Errorf("GroupOf(GPU-a) = %s, %v; want gb, the group a share may join", g, ok)
	}
}

func reservationPod(group string, uid types.UID, uuid string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "gpufrac-n1-" + group, Namespace: "gpufrac-reservations", UID: uid,
		Labels: api.ReservationLabels(group, false)}}
	p.Annotations = api.ReservedGPUWrite(uuid).Apply(nil)
	p.Spec.NodeName = "n1"
	return p
}
