package ledgers

// The life of a GPU group's reservation pod, as one transition function.
//
// A shared GPU is a GPU group held by one reservation pod. The pod's state
// says whether a share may join the group (Joinable) and what the ledger
// must do when the pod changes (the effects, which the caller applies
// through Layout's methods and its own collector). Whether the group has
// tenants is the ledger's, not the state's: a Named group with tenants is
// live, one without is held idle for the next share.
//
//	state     event                    next      effects
//	None      Book (standing, to make) Booked    Hold
//	None      Seen                     by pod    Hold, Wake, Settle
//	Booked    CreateFailed             None      Rebuild
//	Booked    Seen                     by pod    Settle (+Wake: a standing pod named)
//	Pending   Seen                     by pod    Settle (+Wake: a standing pod named)
//	Named     Seen                     by pod    Settle
//	Failed    Seen                     Failed    Settle (Retiring if being deleted)
//	Retiring  Seen                     Retiring  Settle (retiring sticks)
//	any live  Retire                   Retiring  —
//	any       Deleted                  None      Free, Wake (+Rebuild: a standing group)
//
// "by pod" is Seen's own reading of the pod: Retiring when it is being
// deleted, Failed when the kubelet refused it, Named once the node agent
// wrote its GPU, Pending before. Retiring sticks: a group retired is never
// joinable again, so that once idle it stays so and its pod may be deleted.

// GroupState is where a GPU group's reservation pod is in its life.
type GroupState int

const (
	// GroupNone means no reservation pod (never made, or gone).
	GroupNone GroupState = iota
	// GroupBooked means the scheduler is creating a standing pod it booked
	// (the pod is not seen yet); the slot is held meanwhile.
	GroupBooked
	// GroupPending means the pod exists and its GPU is not named yet.
	GroupPending
	// GroupNamed means the node agent wrote the pod's GPU (its UUID).
	GroupNamed
	// GroupFailed means the kubelet refused the pod: no share joins it, and
	// once idle it is deleted (a standing one is then made again).
	GroupFailed
	// GroupRetiring means the scheduler chose to delete the pod (a whole-GPU
	// pod needs the GPU, the node no longer asks for the standing group,
	// the group found no GPU), or it is being deleted.
	GroupRetiring
)

var groupStateNames = [...]string{"None", "Booked", "Pending", "Named", "Failed", "Retiring"}

func (s GroupState) String() string {
	if s < 0 || int(s) >= len(groupStateNames) {
		return "GroupState(?)"
	}
	return groupStateNames[s]
}

// GroupEvent is what happens to a reservation pod.
type GroupEvent int

const (
	// EventBook means the scheduler books a standing group before creating
	// its pod (Cache.TakeStanding).
	EventBook GroupEvent = iota
	// EventCreateFailed means the booked pod could not be created.
	EventCreateFailed
	// EventSeen means the API shows the pod (Seen says how).
	EventSeen
	// EventRetire means the scheduler retires the group.
	EventRetire
	// EventDeleted means the API shows the pod gone.
	EventDeleted
)

var groupEventNames = [...]string{"Book", "CreateFailed", "Seen", "Retire", "Deleted"}

func (e GroupEvent) String() string {
	if e < 0 || int(e) >= len(groupEventNames) {
		return "GroupEvent(?)"
	}
	return groupEventNames[e]
}

// Seen is how the API shows a reservation pod (EventSeen).
type Seen struct {
	// Named: the node agent wrote its GPU.
	Named bool
	// Failed: the kubelet refused it (phase Failed).
	Failed bool
	// Deleting: it has a deletion timestamp.
	Deleting bool
}

// Effects are what a transition asks of the caller, in this order.
type Effects struct {
	// Hold: keep the group's slot held for shares (Layout.Hold).
	Hold bool
	// Free: the pod is gone: give its slot back if idle or retired
	// (Layout.Free).
	Free bool
	// Settle: see whether the group, idle, can still be joined
	// (Layout.Retire and EventRetire when not).
	Settle bool
	// Wake: the collector has work (a pod to make, write or delete).
	Wake bool
	// Rebuild: book the node's ledger again from its pods.
	Rebuild bool
}

// Transition is the reservation pod's next state after an event, and what
// the caller must do. standing says the group is a standing one.
func Transition(s GroupState, e GroupEvent, seen Seen, standing bool) (GroupState, Effects) {
	switch e {
	case EventBook:
		if s == GroupNone {
			return GroupBooked, Effects{Hold: true}
		}
	case EventCreateFailed:
		if s == GroupBooked {
			return GroupNone, Effects{Rebuild: true}
		}
	case EventSeen:
		next := seenState(s, seen)
		fx := Effects{Settle: true}
		switch {
		case s == GroupNone:
			fx.Hold, fx.Wake = true, true
		case standing && next == GroupNamed && s != GroupNamed:
			// The collector writes what a standing GPU holds only once
			// its UUID is known: wake it now rather than at its next
			// tick, or the node offers DRA claims nothing on that GPU for
			// up to half a minute after it comes up.
			fx.Wake = true
		}
		return next, fx
	case EventRetire:
		if s != GroupNone {
			return GroupRetiring, Effects{}
		}
	case EventDeleted:
		return GroupNone, Effects{Free: true, Wake: true, Rebuild: standing}
	}
	return s, Effects{}
}

// seenState is the state the pod's own reading gives, from s.
func seenState(s GroupState, seen Seen) GroupState {
	switch {
	case s == GroupRetiring || seen.Deleting:
		return GroupRetiring
	case s == GroupFailed || seen.Failed:
		return GroupFailed
	case seen.Named:
		return GroupNamed
	}
	return GroupPending
}

// Joinable says whether a share may join a group in state s: its pod is
// booked or alive, neither failed nor retiring, and, for a standing group,
// one the node still asks for (wanted). A group that is not joinable never
// becomes so again.
func Joinable(s GroupState, standing, wanted bool) bool {
	switch s {
	case GroupBooked, GroupPending, GroupNamed:
		return !standing || wanted
	}
	return false
}
